"""The simulator's engine model: chunked-prefill arithmetic, prefix-cache and kvtier hits,
load ordering, and a summary with exactly `kvtier bench run`'s keys and values."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.client.summary import summarize
from kvtier.sim.costs import StepCost
from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile
from kvtier.sim.run import simulate
from kvtier.sim.summary import to_records
from kvtier.sim.trace import load_trace
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, write_workload

ENG = EngineProfile(block_size=16, max_num_batched_tokens=256, max_num_seqs=8, kv_cache_tokens=16 * 200,
                    step_overhead_s=0.01, prefill_token_s=1e-4, prefill_attn_s=1e-7, decode_seq_s=1e-3,
                    decode_ctx_s=1e-6)


def wl(tmp_path, prompts: list[list[list[int]]], max_tokens: int = 4, think: float = 0.0, arrivals=None):
    convs = [Conversation(id=f"c{i}", arrival_s=(arrivals[i] if arrivals else 0.0),
                          turns=[Turn(prompt_token_ids=p, max_tokens=max_tokens, think_time_s=think) for p in conv])
             for i, conv in enumerate(prompts)]
    path = tmp_path / "w.jsonl"
    write_workload(path, WorkloadHeader(name="t"), convs)
    return path


def prof(**kw) -> SimProfile:
    return SimProfile(kv_bytes_per_token=1000, chunk_size=32, engine=kw.pop("engine", ENG), **kw)


def run(path, p: SimProfile, **load):
    tr = load_trace(path, unit_tokens=p.engine.block_size)
    return tr, simulate(tr, p, LoadSpec(**{"mode": "closed", "concurrency": 1, **load}))


def test_cold_prefill_is_the_sum_of_chunked_steps(tmp_path) -> None:
    toks = list(range(1000, 1600))                       # 600 tokens, budget 256: 256 + 256 + 88
    tr, sim = run(wl(tmp_path, [[toks]], max_tokens=1), prof(save=False))
    c = StepCost.of(ENG)
    want = sum(c.step(n, c.pairs(done, n), 0, 0) for done, n in ((0, 256), (256, 256), (512, 88)))
    assert sim.result.ttft_s[0] == pytest.approx(want)
    assert sim.summary["token_hit_rate"] == 0.0


def test_repeat_hits_vllm_cache_up_to_the_last_block_and_is_faster(tmp_path) -> None:
    toks = list(range(2000, 2320))                       # 320 tokens = 20 blocks
    tr, sim = run(wl(tmp_path, [[toks, toks]]), prof(save=False))
    r = sim.result
    assert r.tier_tokens["gpu"].tolist() == [0, 304]     # (320 - 1) // 16 blocks: the last one is recomputed
    assert r.ttft_s[1] < r.ttft_s[0] / 3


def test_kvtier_ram_serves_what_vllm_evicted_and_the_load_costs_time(tmp_path) -> None:
    rng = random.Random(0)
    a = [rng.randrange(5000) for _ in range(320)]
    fill = [[rng.randrange(5000) for _ in range(320)] for _ in range(2)]
    small = ENG.model_copy(update={"kv_cache_tokens": 16 * 25})     # room for one prompt only
    path = wl(tmp_path, [[a, fill[0], fill[1], a]])
    _, van = run(path, prof(engine=small, save=False))
    p = prof(engine=small, ram=TierProfile(capacity=10**9, read_bw=1e7, op_latency_s=0.002))
    _, kv = run(path, p)
    assert van.result.cached_tokens[3] == 0
    assert kv.result.tier_tokens["ram"][3] == 304        # whole blocks below prompt - 1 (last chunk in part)
    assert kv.result.load_s[3] == pytest.approx(0.002 + 10 * 32 * 1000 / 1e7)     # 10 chunks read
    assert kv.result.ttft_s[3] < van.result.ttft_s[3]


def test_closed_loop_sends_next_turn_after_finish_plus_think(tmp_path) -> None:
    t1 = list(range(100, 200))
    path = wl(tmp_path, [[t1, t1 + list(range(300, 340))], [list(range(500, 700))]], think=2.0)
    tr, sim = run(path, prof(save=False), concurrency=1, think_time_scale=1.5)
    r = sim.result
    assert r.send_s[1] == pytest.approx(r.send_s[0] + r.e2e_s[0] + 3.0)
    assert r.send_s[2] == pytest.approx(r.send_s[1] + r.e2e_s[1])          # user takes the next conversation
    _, sim2 = run(path, prof(save=False), concurrency=2, think_time_scale=0.0)
    assert sim2.result.send_s[2] == 0.0


def test_open_and_trace_modes_follow_the_replay_arrivals(tmp_path) -> None:
    path = wl(tmp_path, [[list(range(i * 100, i * 100 + 64))] for i in range(5)], arrivals=[0, 1, 2, 3, 40])
    _, tr_sim = run(path, prof(save=False), mode="trace", time_scale=0.5)
    assert tr_sim.result.send_s.tolist() == [0.0, 0.5, 1.0, 1.5, 20.0]
    _, op = run(path, prof(save=False), mode="open", rate=2.0, seed=3)
    rng, t, want = random.Random(3), 0.0, []
    for _ in range(5):
        want.append(t)
        t += rng.expovariate(2.0)
    assert op.result.send_s.tolist() == pytest.approx(want)


def test_batching_shares_steps_and_limits_hold(tmp_path) -> None:
    path = wl(tmp_path, [[list(range(i * 1000, i * 1000 + 100))] for i in range(6)], max_tokens=20)
    _, one = run(path, prof(save=False), concurrency=1)
    _, six = run(path, prof(save=False), concurrency=6)
    assert six.result.duration_s < one.result.duration_s / 2       # decodes batched in shared steps
    _, cut = run(path, prof(save=False), concurrency=6, max_requests=4)
    assert cut.summary["requests_total"] == 4


def test_summary_has_bench_keys_and_values(tmp_path) -> None:
    rng = random.Random(5)
    convs = [[[rng.randrange(9000) for _ in range(rng.randrange(50, 700))] for _ in range(3)] for _ in range(4)]
    convs = [[c[0], c[0] + c[1], c[0] + c[1] + c[2]] for c in convs]
    path = wl(tmp_path, convs, max_tokens=5, think=1.0)
    tr, sim = run(path, prof(ram=TierProfile(capacity=10**8)), concurrency=2)
    recs = to_records(tr, sim.result)
    ref = summarize(recs, duration_s=sim.summary["duration_s"])
    for k, v in ref.items():
        if k in ("itl_mean_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "itl_max_s"):
            continue                                      # records carry no per-token gaps
        got = sim.summary[k]
        if k == "hit_rate_over_time":
            got = [{kk: vv for kk, vv in w.items() if kk != "tier_hit_rate"} for w in got]
        assert _close(got, v), k
    assert sim.summary["token_hit_rate"] > 0.3


def _close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.isclose(a, b)
    return a == b


def test_trace_nominal_order_matches_the_workload_order(tmp_path) -> None:
    from kvtier.workload.format import load_workload
    rng = random.Random(2)
    convs = [Conversation(id=f"c{i}", arrival_s=rng.random() * 5,
                          turns=[Turn(prompt_token_ids=[rng.randrange(99) for _ in range(20)],
                                      think_time_s=rng.random() * 3) for _ in range(rng.randrange(1, 4))])
             for i in range(12)]
    path = tmp_path / "w.jsonl"
    write_workload(path, WorkloadHeader(name="t"), convs)
    tr = load_trace(path, unit_tokens=4)
    flat = [(ci, k) for ci, c in enumerate(convs) for k in range(len(c.turns))]
    assert [flat[r] for r in tr.nominal_order().tolist()] == load_workload(path).request_order()
