"""Workload stats: ideal prefix hit rate on hand-built workloads with known answers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from kvtier.workload.format import Conversation, Turn, Workload, WorkloadHeader
from kvtier.workload.stats import PrefixBlockSet, ideal_hit_rate, workload_stats
from tests.unit.workload_fakes import WordTokenizer


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _wl(*convs: Conversation) -> Workload:
    return Workload(header=WorkloadHeader(name="t"), conversations=list(convs))


def test_known_answer_token_id_workload():
    a0 = _ids(0, 512)                   # 2 blocks, all new
    a1 = a0 + _ids(10_000, 300)         # 812 tokens: hits 512 (blocks 0-1), block 2 new, 44 partial
    b0 = _ids(0, 256) + _ids(20_000, 100)  # shares block 0 with A: hits 256
    wl = _wl(Conversation(id="a", arrival_s=0.0, turns=[Turn(prompt_token_ids=a0),
                                                        Turn(prompt_token_ids=a1, think_time_s=10.0)]),
             Conversation(id="b", arrival_s=5.0, turns=[Turn(prompt_token_ids=b0)]))
    st = workload_stats(wl, None, block_size=256)
    assert st.requests == 3 and st.total_prompt_tokens == 512 + 812 + 356
    assert st.ideal_hit_tokens == 512 + 256
    assert st.ideal_hit_rate == pytest.approx(768 / 1680)
    assert wl.request_order() == [(0, 0), (1, 0), (0, 1)]  # b arrives between a's turns


def test_arrival_order_decides_who_pays_the_miss():
    shared = _ids(0, 256)
    early = Conversation(id="x", arrival_s=9.0, turns=[Turn(prompt_token_ids=shared + [1])])
    late = Conversation(id="y", arrival_s=1.0, turns=[Turn(prompt_token_ids=shared + [2])])
    wl = _wl(early, late)
    assert wl.request_order() == [(1, 0), (0, 0)]
    assert workload_stats(wl, None, 256).ideal_hit_tokens == 256


def test_partial_blocks_never_hit_and_chain_is_positional():
    s = PrefixBlockSet(4)
    assert s.lookup_and_insert([1, 2, 3]) == 0
    assert s.lookup_and_insert([1, 2, 3]) == 0          # no full block
    assert s.lookup_and_insert([1, 2, 3, 4, 5, 6, 7, 8]) == 0
    assert s.lookup_and_insert([5, 6, 7, 8]) == 0       # same tokens, other position: miss
    assert s.lookup_and_insert([1, 2, 3, 4, 9, 9, 9, 9]) == 4
    assert s.lookup_and_insert([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_chat_history_hits_with_a_tokenizer():
    tok = WordTokenizer()
    conv = Conversation(id="c", system="w1 w2 w3", turns=[Turn(user="u1 u2", assistant="a1 a2 a3"),
                                                         Turn(user="u3", assistant="a4")])
    wl = _wl(conv)
    # prompt 1: [1 system w1 w2 w3 2] [1 user u1 u2 2] [1 assistant] = 6 + 5 + 2 = 13 tokens
    # prompt 2: the first 11 + [1 assistant a1 a2 a3 2] + [1 user u3 2] + [1 assistant] = 11 + 6 + 4 + 2 = 23
    st = workload_stats(wl, tok, block_size=4)
    assert st.prompt_tokens.min == 13 and st.prompt_tokens.max == 23
    # prompt 2 starts with prompt 1's first 13 tokens ("[1 assistant" opens the reply), so
    # prompt 1's 3 full blocks all hit; its 4th block differs (a1 a2 a3 ...).
    assert st.ideal_hit_tokens == 12
    assert ideal_hit_rate(wl, tok, 4) == pytest.approx(12 / 36)


def test_stats_summary_fields_are_json_ready():
    wl = _wl(*[Conversation(id=f"c{i}", metadata={"persona": "p1" if i % 2 else "p2"},
                            turns=[Turn(user=f"hello {i}")] * (i + 1)) for i in range(4)])
    st = workload_stats(wl)
    assert st.turns_histogram == {1: 1, 2: 1, 3: 1, 4: 1}
    assert st.turns.mean == pytest.approx(2.5) and st.requests == 10
    assert st.metadata_counts["persona"] == {"p1": 2, "p2": 2}
    assert json.loads(json.dumps(st.to_dict()))["ideal_hit_rate"] == st.ideal_hit_rate


@given(st_prompts=hst.lists(hst.lists(hst.integers(0, 3), max_size=24), max_size=12), bs=hst.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_block_set_matches_a_naive_prefix_model(st_prompts, bs):
    """Hit tokens == longest multiple of bs whose whole prefix appeared (as full blocks) before."""
    blocks = PrefixBlockSet(bs)
    seen: set[tuple[int, ...]] = set()
    for ids in st_prompts:
        full = len(ids) // bs
        expect = 0
        for b in range(1, full + 1):
            if tuple(ids[: b * bs]) in seen:
                expect = b * bs
            else:
                break
        assert blocks.lookup_and_insert(ids) == expect
        seen.update(tuple(ids[: b * bs]) for b in range(1, full + 1))
