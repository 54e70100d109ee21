"""Long-document QA generator with a fake (word-level) tokenizer: exact lengths, revisits."""

from __future__ import annotations

import pytest

from kvtier.workload.format import Workload, write_workload
from kvtier.workload.longdoc import LongDocSpec, fit_to_tokens, generate_longdoc
from kvtier.workload.longdoc_text import PaperFacts
from kvtier.workload.stats import workload_stats
from tests.unit.workload_fakes import WordTokenizer


def test_documents_have_exact_token_lengths():
    tok = WordTokenizer()
    _, convs = generate_longdoc(LongDocSpec(documents=3, doc_tokens=700, spread=0.0, questions=2), tok)
    for c in convs:
        assert c.metadata["doc_tokens"] == 700
        assert c.metadata["prompt_tokens"] == len(tok.render_chat(c.chat_messages(0)))
        assert c.metadata["prompt_tokens"] <= 7000


def test_fit_to_tokens_cuts_exactly():
    import random
    tok = WordTokenizer()
    for target in (17, 256, 1001):
        text, n = fit_to_tokens(tok, PaperFacts(random.Random(target)).paragraphs(), target)
        assert n == target == len(tok.encode(text))


def test_interleaved_revisits_and_prompt_cap():
    tok = WordTokenizer()
    spec = LongDocSpec(documents=5, doc_tokens=3000, spread=0.5, questions=3, interleave=2, max_prompt_length=2000,
                       system="You answer questions about papers.")
    _, convs = generate_longdoc(spec, tok)
    assert [c.id for c in convs[:6]] == ["d000-q0", "d001-q0", "d000-q1", "d001-q1", "d000-q2", "d001-q2"]
    assert convs[-1].id == "d004-q2" and len(convs) == 15
    assert all(c.metadata["prompt_tokens"] <= 2000 for c in convs)
    assert all(c.system == spec.system for c in convs)
    arrivals = [c.arrival_s for c in convs]
    assert arrivals == sorted(arrivals)
    same_doc = [c.turns[0].user for c in convs if c.metadata["doc"] == "d000"]
    assert len(set(same_doc)) == 3  # different questions ...
    prefix = same_doc[0][: same_doc[0].index("Now the paper ends.")]
    assert all(u.startswith(prefix) for u in same_doc)  # ... after the same document


def test_revisits_give_a_high_ideal_hit_rate_and_determinism(tmp_path):
    tok = WordTokenizer()
    spec = LongDocSpec(documents=4, doc_tokens=1500, questions=4, seed=3)
    h1, c1 = generate_longdoc(spec, tok)
    h2, c2 = generate_longdoc(spec, WordTokenizer())
    write_workload(tmp_path / "a.jsonl", h1, c1)
    write_workload(tmp_path / "b.jsonl", h2, c2)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    st = workload_stats(Workload(header=h1, conversations=c1), tok, block_size=64)
    assert st.ideal_hit_rate > 0.6  # 3 of 4 visits of each document reuse it


@pytest.mark.parametrize("field,value", [("documents", 0), ("spread", 1.0), ("questions", 99)])
def test_bad_spec(field, value):
    with pytest.raises(ValueError, match=field):
        generate_longdoc(LongDocSpec(**{field: value}), WordTokenizer())


def test_prompt_length_too_small_for_any_document():
    with pytest.raises(ValueError, match="no room"):
        generate_longdoc(LongDocSpec(max_prompt_length=128, system="x " * 200), WordTokenizer())
