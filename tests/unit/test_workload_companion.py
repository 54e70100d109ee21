"""Companion generator: determinism, distributions, text variety, prompt limits."""

from __future__ import annotations

import itertools
import re
import statistics

import pytest

from kvtier.workload.companion import CompanionSpec, generate_companion
from kvtier.workload.format import Workload, load_workload, write_workload
from kvtier.workload.tokens import ApproxTokenizer, approx_token_count


def _write(tmp_path, name, spec):
    header, convs = generate_companion(spec)
    p = tmp_path / name
    write_workload(p, header, convs)
    return p


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = _write(tmp_path, "a.jsonl", CompanionSpec(conversations=30, seed=7))
    b = _write(tmp_path, "b.jsonl", CompanionSpec(conversations=30, seed=7))
    c = _write(tmp_path, "c.jsonl", CompanionSpec(conversations=30, seed=8))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert len(load_workload(a).conversations) == 30


def test_turn_counts_follow_the_configured_distribution():
    spec = CompanionSpec(conversations=600, turns_mean=5.0, turns_max=16, max_prompt_tokens=100_000, seed=1)
    _, convs = generate_companion(spec)
    turns = [len(c.turns) for c in convs]
    assert min(turns) == 1 and max(turns) <= 16
    assert 4.3 <= statistics.mean(turns) <= 5.7
    assert sum(n >= 12 for n in turns) >= 10  # a tail of long chats
    assert sum(n == 1 for n in turns) >= 60  # and many one-shot ones


def test_lognormal_turns_respect_the_cap():
    _, convs = generate_companion(CompanionSpec(conversations=200, turns_dist="lognormal", turns_max=9, seed=2))
    assert all(1 <= len(c.turns) <= 9 for c in convs)


def test_short_and_long_prompts_and_persona_lengths():
    spec = CompanionSpec(conversations=150, seed=3)
    header, convs = generate_companion(spec)
    approx = ApproxTokenizer()
    wl = Workload(header=header, conversations=convs)
    lengths = [len(approx.render_chat(convs[ci].chat_messages(k))) for ci, k in wl.request_order()]
    assert max(lengths) <= spec.max_prompt_tokens
    assert min(lengths) < 700 and max(lengths) > 3500
    personas = {c.metadata["persona"]: approx_token_count(c.system) for c in convs}
    assert len(personas) == spec.personas
    assert min(personas.values()) < 450 and max(personas.values()) > 1500
    assert any(c.metadata["resumed"] and c.history for c in convs)
    replies = [approx_token_count(t.assistant) for c in convs for t in c.turns]
    assert min(replies) < 60 and max(replies) > 250  # tens to a few hundred tokens


def _words(conv) -> list[str]:
    text = " ".join(f"{t.user} {t.assistant}" for t in conv.turns)
    return re.findall(r"[a-z]+", text.lower())


def test_conversations_share_little_text():
    _, convs = generate_companion(CompanionSpec(conversations=40, seed=4))
    words = [set(_words(c)) for c in convs]
    trigrams = [set(zip(w, w[1:], w[2:])) for w in (_words(c) for c in convs)]
    jac = lambda a, b: len(a & b) / len(a | b)  # noqa: E731
    assert statistics.mean(jac(a, b) for a, b in itertools.combinations(words, 2)) < 0.4
    assert statistics.mean(jac(a, b) for a, b in itertools.combinations(trigrams, 2)) < 0.2
    users = [t.user for c in convs for t in c.turns]
    assert len(set(users)) == len(users)
    vocab = set().union(*words)
    assert len(vocab) > 1000  # a large vocabulary, not repeated filler


def test_same_persona_prompts_diverge_in_the_first_user_message():
    _, convs = generate_companion(CompanionSpec(conversations=60, seed=5))
    by_persona: dict[str, list] = {}
    for c in convs:
        by_persona.setdefault(c.metadata["persona"], []).append(c)
    a, b = next(v for v in by_persona.values() if len(v) >= 2)[:2]
    assert a.system == b.system
    ma, mb = a.chat_messages(0), b.chat_messages(0)
    assert ma[-1]["content"] != mb[-1]["content"]


def test_arrivals_are_poisson_like_and_think_times_positive():
    _, convs = generate_companion(CompanionSpec(conversations=300, rate=2.0, seed=6))
    arrivals = [c.arrival_s for c in convs]
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert 0.35 <= statistics.mean(gaps) <= 0.65  # mean 1/rate
    later = [t.think_time_s for c in convs for t in c.turns[1:]]
    assert all(x > 0 for x in later) and max(later) > 30  # some long "away" pauses


@pytest.mark.parametrize("field,value", [("conversations", 0), ("turns_mean", 20.0), ("rate", 0.0),
                                         ("resume_fraction", 1.5)])
def test_bad_spec_is_rejected(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-").split("-")[0]):
        generate_companion(CompanionSpec(**{field: value}))


@pytest.mark.timeout(30)
def test_flat_turn_distribution_draws_without_hanging():
    """turns-mean at (1 + turns-max) / 2 made the rejection sampler spin forever (hung on main before
    the fix, e.g. `kvtier workload companion --turns-max 5 --turns-mean 3`)."""
    import random

    from kvtier.workload.companion import _num_turns

    spec = CompanionSpec(conversations=3, turns_max=5, turns_mean=3.0)
    spec.validate()
    rng = random.Random(0)
    draws = [_num_turns(rng, spec) for _ in range(4000)]
    assert set(draws) == {1, 2, 3, 4, 5}
    assert abs(statistics.mean(draws) - 3.0) < 0.1


def test_turn_mean_above_the_flattest_geometric_is_refused():
    with pytest.raises(ValueError, match=r"\(1 \+ turns-max\) / 2"):
        CompanionSpec(turns_max=5, turns_mean=4.0).validate()
