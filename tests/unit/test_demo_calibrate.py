"""Calibration and sizing on a fake timing function: the fit, the budget, and a size that keeps
the experiment's ratios while aiming at the target wall time."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtier.demo import companion
from kvtier.demo.calibrate import (REFERENCE_PREFILL_1K_S, Calibration, CalibrationError, fit_profile, load_calibration,
                                   measure_profile)
from kvtier.demo.common import ModelFacts
from kvtier.demo.live import engine_size
from kvtier.demo.regime import regime_for, user_candidates
from kvtier.demo.sizing import (NEIGHBOURS, OVER_TARGET, SLACK, TurnFacts, WorkloadFacts, closed_loop_seconds,
                                config_seconds, estimate, max_model_len, scaled, size_companion)


def linear_machine(per_1k_s: float, fixed_s: float = 0.05):
    calls: list[int] = []

    def time_prefill(n: int) -> float:
        calls.append(n)
        return fixed_s + per_1k_s * n / 1024
    return time_prefill, calls


def test_fit_recovers_a_linear_machine():
    fn, calls = linear_machine(4.5)
    p = measure_profile(fn, (256, 512, 1024), budget_s=60)
    assert calls[0] <= 64 and calls[1:] == [256, 512, 1024]      # warm-up first, not recorded
    assert [n for n, _ in p.points] == [256, 512, 1024]
    assert p.seconds(1024) == pytest.approx(4.55, rel=1e-3)
    assert p.seconds(2048) == pytest.approx(0.05 + 9.0, rel=1e-3)
    assert p.speed_factor() == pytest.approx(4.55 / REFERENCE_PREFILL_1K_S, rel=1e-3)
    assert p.tokens_for(p.seconds(700)) == pytest.approx(700, abs=1)


def test_fit_keeps_a_quadratic_term():
    p = fit_profile([(256, 0.5 + 256 * 1e-3 + 256 ** 2 * 1e-6), (512, 0.5 + 512e-3 + 512 ** 2 * 1e-6),
                     (1024, 0.5 + 1024e-3 + 1024 ** 2 * 1e-6)])
    assert (p.a, p.b, p.c) == pytest.approx((0.5, 1e-3, 1e-6), rel=1e-6)
    assert p.extend_seconds(1000, 100) == pytest.approx(100e-3 + (1100 ** 2 - 1000 ** 2) * 1e-6)


def test_budget_skips_lengths_that_would_overrun_it():
    spent: list[float] = []

    def slow(n: int) -> float:                # 1K tokens = 40 s: the third length would blow 60 s
        spent.append(0.05 + 40.0 * n / 1024)
        return spent[-1]
    p = measure_profile(slow, (256, 512, 1024), budget_s=60, clock=lambda: sum(spent))
    assert [n for n, _ in p.points] == [256, 512] and p.elapsed_s == pytest.approx(sum(spent))


@pytest.mark.parametrize("points,msg", [([(256, 1.0)], "two or more"), ([(256, 1.0), (512, 0.0)], "non-positive"),
                                        ([(256, 2.0), (1024, 1.0)], "does not grow")])
def test_nonsense_timings_are_one_clear_error(points, msg):
    with pytest.raises(CalibrationError, match=msg):
        fit_profile(points)


def test_calibration_round_trips_and_checks_the_dtype(tmp_path):
    cal = Calibration(profile=fit_profile([(256, 1.0), (1024, 4.0)]), startup_s=40.0, dtype="float32")
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps({"calibration": cal.to_dict()}))
    back = load_calibration(p, "float32")
    assert back.profile.seconds(512) == pytest.approx(cal.profile.seconds(512)) and back.startup_s == 40.0
    with pytest.raises(CalibrationError, match="dtype float32"):
        load_calibration(p, "bfloat16")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match="cannot read"):
        load_calibration(tmp_path / "bad.json", None)


def companion_facts() -> ModelFacts:
    from pathlib import Path

    return ModelFacts(path=Path("/nonexistent/model"), kv_bytes_per_token=46_080, max_model_len=8192, dtype="float32")


def fake_facts(size) -> WorkloadFacts:
    """A workload model: conversations of uneven length (0.5x, 1x, 1.5x the mean turns, in turn),
    prompts growing with the token lengths, 80% of a later turn's prompt an ideal hit."""
    mean_prompt = size.system_tokens + 4 * (size.user_tokens + size.assistant_tokens)
    convs = tuple(tuple(TurnFacts(mean_prompt, int(mean_prompt * 0.8) if k else 0, size.think_time_s if k else 0.0)
                        for k in range(max(1, round(size.turns_mean * (0.5 + (i % 3) / 2)))))
                  for i in range(size.conversations))
    turns = [t for c in convs for t in c]
    return WorkloadFacts(requests=len(turns), prompt_tokens=sum(t.prompt_tokens for t in turns),
                         ideal_hit_tokens=sum(t.ideal_hit_tokens for t in turns),
                         think_s=sum(t.think_s for t in turns), max_prompt_tokens=size.max_prompt_tokens,
                         conversations=convs)


def test_closed_loop_one_user_plays_everything_in_turn():
    # (work, think before the turn): 1 + (3 + 2) + 0.5
    assert closed_loop_seconds([[(1.0, 0.0), (2.0, 3.0)], [(0.5, 0.0)]], users=1) == pytest.approx(6.5)


def test_closed_loop_users_share_the_engine():
    # two 1 s requests at once: each gets half the engine, both end at 2 s
    assert closed_loop_seconds([[(1.0, 0.0)], [(1.0, 0.0)]], users=2) == pytest.approx(2.0)
    assert closed_loop_seconds([[(1.0, 0.0)], [(1.0, 0.0)]], users=1) == pytest.approx(2.0)
    # one user thinking while the other is served: no sharing
    assert closed_loop_seconds([[(1.0, 0.0), (1.0, 5.0)], [(1.0, 1.0)]], users=2) == pytest.approx(7.0)


def test_the_last_long_conversation_runs_alone():
    """The closed loop's tail: 2 users, two short chats, then a long one that starts only when the
    first user is free (at 2 s) and then runs alone: 2 + 1 + 10 + 1 + 10 + 1 = 25 s. The aggregate
    formula max(W, (W + think) / users) said 12.5 s: half of what the run takes."""
    long = [(1.0, 0.0), (1.0, 10.0), (1.0, 10.0)]
    assert closed_loop_seconds([[(1.0, 0.0)], [(1.0, 0.0)], long], users=2) == pytest.approx(25.0)
    # the same through the per-configuration estimate: a machine with 1 s per request, no cache
    prof = fit_profile([(256, 1.0), (1024, 1.0 + 1e-9)])
    one = TurnFacts(prompt_tokens=256, ideal_hit_tokens=0, think_s=0.0)
    convs = ((one,), (one,), (one, TurnFacts(256, 0, 10.0), TurnFacts(256, 0, 10.0)))
    facts = WorkloadFacts(requests=5, prompt_tokens=5 * 256, ideal_hit_tokens=0, think_s=20.0, max_prompt_tokens=256,
                          conversations=convs)
    assert config_seconds(prof, facts, users=2, think_time_scale=1.0, hit_share=1.0) == pytest.approx(SLACK * 25.0,
                                                                                                        rel=1e-6)
    aggregate = dataclasses.replace(facts, conversations=())
    assert config_seconds(prof, aggregate, users=2, think_time_scale=1.0, hit_share=1.0) < 0.6 * 25.0


def test_hits_shorten_the_estimate_by_the_cached_prefill():
    prof = fit_profile([(256, 0.3), (512, 0.55), (1024, 1.05)])
    convs = ((TurnFacts(1000, 0, 0.0), TurnFacts(1200, 1000, 1.0)),)
    facts = WorkloadFacts(requests=2, prompt_tokens=2200, ideal_hit_tokens=1000, think_s=1.0, max_prompt_tokens=1200,
                          conversations=convs)
    full, none = (config_seconds(prof, facts, 1, 1.0, share) for share in (1.0, 0.0))
    assert full == pytest.approx(SLACK * (prof.seconds(1000) + 1.0 + prof.a + prof.extend_seconds(1000, 200)))
    assert none == pytest.approx(SLACK * (prof.seconds(1000) + 1.0 + prof.seconds(1200)))


@pytest.mark.parametrize("per_1k_s", [0.8, 1.6, 4.5, 12.0])
@pytest.mark.parametrize("base", [companion.DEFAULT, companion.QUICK])
def test_size_aims_at_the_target_in_the_regime(base, per_1k_s):
    """Users are one of the interleavings the regime tries (never more than the conversations); the
    capacities are the curve's points, not fractions of the working set; think time vs service time is
    kept; a size the estimate puts about the target reaches the regime, and a few more conversations
    would be over the target."""
    fn, _ = linear_machine(per_1k_s)
    prof = measure_profile(fn, (256, 512, 1024))
    sz = size_companion(base, prof, startup_s=40.0, target_s=base.target_s, facts_of=fake_facts)
    s = sz.size
    assert s.concurrency in user_candidates(base.concurrency) or s.concurrency == s.conversations
    assert s.concurrency <= s.conversations
    assert sz.regime is not None and sz.regime.users == s.concurrency
    b = companion.budgets(s, companion_facts(), sz.facts, sz.regime)
    assert (b.engine_kv_tokens, b.ram_tokens, b.ssd_tokens) == (sz.regime.engine.tokens, sz.regime.ram.tokens,
                                                                sz.regime.ssd.tokens)
    assert b.engine_kv_tokens % 128 == 0 and b.engine_kv_tokens >= max_model_len(engine_size(s, "live")) + 128
    # think time vs service time: think times follow the machine's remaining slowness
    assert s.think_time_scale == pytest.approx(base.think_time_scale * prof.speed_factor() * sz.length_scale)
    # the estimate of the chosen size: each configuration at its predicted hit rate, queueing for the chosen engine KV
    assert sz.estimate_s == pytest.approx(estimate(prof, 40.0, s, sz.facts, "live", sz.regime)[0])
    if not sz.over_target:
        assert sz.estimate_s <= OVER_TARGET * base.target_s and sz.regime.reached
        bigger = dataclasses.replace(scaled(base, sz.length_scale, sz.think_scale, s.conversations + NEIGHBOURS + 1),
                                     concurrency=s.concurrency)
        bf = fake_facts(bigger)
        assert estimate(prof, 40.0, bigger, bf, "live", regime_for(bigger, bf, prof, ttft_model=False))[0] > base.target_s
    slower = size_companion(base, measure_profile(linear_machine(per_1k_s * 2)[0], (256, 512, 1024)), 40.0,
                            base.target_s, fake_facts)
    assert slower.facts.prompt_tokens <= sz.facts.prompt_tokens or slower.over_target


def test_overrides_win_and_are_reported():
    prof = measure_profile(linear_machine(4.5)[0], (256, 512, 1024))
    sz = size_companion(companion.DEFAULT, prof, 40.0, 900, fake_facts, users=3, conversations=5)
    assert (sz.size.concurrency, sz.size.conversations) == (3, 5) and sz.overridden == ("users", "conversations")


def test_a_very_slow_machine_is_over_target_but_keeps_one_full_request_in_the_engine():
    prof = measure_profile(linear_machine(400.0)[0], (256, 512, 1024), budget_s=1e9)
    sz = size_companion(companion.QUICK, prof, 40.0, 360, fake_facts)
    assert sz.over_target
    assert sz.regime.engine.tokens >= max_model_len(engine_size(sz.size, "live")) + 128


def test_server_timer_sends_fresh_token_prompts_and_fails_clearly():
    from kvtier.demo.calibrate import random_prompt, server_prefill_timer
    from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer

    assert random_prompt(50, seed=1) != random_prompt(50, seed=2) and len(random_prompt(50, seed=1)) == 50
    with FakeOpenAIServer.start(FakeBehavior(first_token_delay_s=0.05)) as srv:
        timer = server_prefill_timer(srv.url)
        assert timer(300) >= 0.05 and timer(600) >= 0.05
        bodies = [r.body for r in srv.state.requests]
        assert [len(b["prompt"]) for b in bodies] == [300, 600] and all(b["max_tokens"] == 1 for b in bodies)
        assert srv.state.cached_tokens == 0          # nothing shared between calibration prompts
    with pytest.raises(CalibrationError, match="failed"):
        server_prefill_timer(srv.url, request_timeout_s=2)(100)   # the server is gone
