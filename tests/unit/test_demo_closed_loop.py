"""The closed loop the companion estimate models: requests run only while their KV fits in the engine's
KV space (the rest queue first come first served), so a small engine serialises requests, their decode
is not batched, and TTFT includes the wait. On a 2-vCPU AVX-512 demo run (engine KV 2,048 tokens, 8
users, vanilla) the model without the limit said 257 s and a 6.9 s mean TTFT, with it 305 s and 11.8 s;
the run took 299 s at 11.2 s (benchmarks/demo_estimate/reestimate.py)."""

from __future__ import annotations

import pytest

from kvtier.demo.closed_loop import closed_loop_run
from kvtier.demo.sizing import closed_loop_seconds

# two conversations of one turn each: 1 s of prefill, then 10 tokens at 0.1 s a step; 600 KV tokens each
TWO = [[(1.0, 0.0, 10, 600)], [(1.0, 0.0, 10, 600)]]


def step(m: float) -> float:
    return 0.1


def test_without_a_kv_limit_both_run_together():
    r = closed_loop_run(TWO, users=2, decode_step=step)
    # prefill shared (2 s for both), then decoding together: 10 steps of 0.1 s
    assert r.makespan_s == pytest.approx(3.0)
    assert r.ttft_s == {(0, 0): pytest.approx(2.0), (1, 0): pytest.approx(2.0)}
    assert r.mean_queue() == 0.0


def test_a_kv_space_for_one_request_serialises_them_and_the_second_waits():
    r = closed_loop_run(TWO, users=2, decode_step=step, kv_tokens=1000)
    assert r.makespan_s == pytest.approx(4.0)                      # (1 + 1) s each, one after the other
    assert r.queue_s[(0, 0)] == 0.0 and r.queue_s[(1, 0)] == pytest.approx(2.0)
    assert r.ttft_s[(0, 0)] == pytest.approx(1.0) and r.ttft_s[(1, 0)] == pytest.approx(3.0)
    assert r.mean_ttft() == pytest.approx(2.0) and r.mean_ttft(returning_only=True) is None
    assert closed_loop_seconds(TWO, 2, step, kv_tokens=1000) == pytest.approx(4.0)
    # enough room for both: the same as no limit; a request larger than the space still runs alone
    assert closed_loop_run(TWO, 2, step, kv_tokens=1200).makespan_s == pytest.approx(3.0)
    assert closed_loop_run(TWO, 2, step, kv_tokens=100).makespan_s == pytest.approx(4.0)


def test_returning_turns_and_turns_without_kv_tokens():
    convs = [[(1.0, 0.0, 0, 500), (0.5, 2.0, 0, 700)]]
    r = closed_loop_run(convs, users=1, decode_step=step, kv_tokens=1000)
    assert r.makespan_s == pytest.approx(3.5) and r.mean_ttft(returning_only=True) == pytest.approx(0.5)
    # older 2- and 3-tuples hold no KV: never queued
    assert closed_loop_run([[(1.0, 0.0)], [(1.0, 0.0)]], users=2, kv_tokens=1).makespan_s == pytest.approx(2.0)
