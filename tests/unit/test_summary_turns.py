"""The speedup on the returning turns alone (turn > 0, where a prefix cache acts) beside the all-turns
one, from two replays' summaries."""

from __future__ import annotations

import pytest

from kvtier.client.stream import RequestRecord
from kvtier.client.summary import summarize, turn_speedups


def rec(turn: int, ttft: float) -> RequestRecord:
    return RequestRecord(conversation_id="c", turn=turn, api="chat", start_s=float(turn), ttft_s=ttft,
                         e2e_s=ttft + 0.1, itl_s=[], prompt_tokens=100, cached_tokens=0, output_tokens=1)


def test_returning_turns_ratio_next_to_the_all_turns_one():
    base = summarize([rec(0, 2.0), rec(1, 8.0), rec(2, 8.0)], duration_s=10.0)
    fast = summarize([rec(0, 2.0), rec(1, 2.0), rec(2, 2.0)], duration_s=10.0)
    sp = turn_speedups(base, fast)
    assert sp["returning_turns"] == pytest.approx(4.0) and sp["first_turns"] == pytest.approx(1.0)
    assert sp["all_turns"] == pytest.approx(6.0 / 2.0)


def test_missing_groups_give_none():
    base = summarize([rec(0, 2.0)], duration_s=1.0)
    assert turn_speedups(base, base) == {"all_turns": 1.0, "first_turns": 1.0, "returning_turns": None}
    assert turn_speedups(None, base)["all_turns"] is None
