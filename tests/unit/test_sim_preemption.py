"""vLLM's recompute preemption in the engine model, on scenarios small enough to do by hand.

Engine: blocks of 4 tokens, a pool of 6 blocks, no prefix caching, every step 1 s (no
per-token cost), so times count steps. Two requests A and B arrive at t=0, prompts of 8
tokens (2 blocks), 6 output tokens each.

With preemption (vLLM v1): step 1 admits both (4 blocks) and completes both prefills: TTFT
1 s each. At step 2 each context reaches 9 tokens: one more block each (6 of 6). At step 6
each needs its 4th block (13 tokens): none is free, so B (the newest) is preempted after
producing 5 tokens (steps 1-5) and frees its 3 blocks; A gets one and finishes in step 6
(e2e 6 s); nothing new is admitted in step 6. Step 7 re-admits B to recompute 8 + 5 = 13
tokens, which produces its 6th and last token: e2e 7 s, TTFT still 1 s.

Reserving prompt + output at admission instead (``preemption: false``): A takes
ceil(14 / 4) = 4 blocks, B does not fit until A finishes at 6 s; B's prefill is step 7
(TTFT 7 s) and its last token step 12 (e2e 12 s).
"""

from __future__ import annotations

import pytest

from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import EngineProfile, SimProfile
from kvtier.sim.run import simulate
from kvtier.sim.trace import load_trace
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, write_workload

ENG = EngineProfile(block_size=4, max_num_batched_tokens=100, max_num_seqs=8, kv_cache_tokens=24,
                    prefix_caching=False, step_overhead_s=1.0, prefill_token_s=0.0, prefill_attn_s=0.0,
                    decode_seq_s=0.0, decode_ctx_s=0.0)


def _run(tmp_path, prompts: list[list[int]], out: int, preemption: bool):
    convs = [Conversation(id=f"c{i}", turns=[Turn(prompt_token_ids=p, max_tokens=out)]) for i, p in enumerate(prompts)]
    path = tmp_path / "w.jsonl"
    write_workload(path, WorkloadHeader(name="t"), convs)
    prof = SimProfile(kv_bytes_per_token=1000, chunk_size=4, save=False,
                      engine=ENG.model_copy(update={"preemption": preemption}))
    tr = load_trace(path, unit_tokens=4)
    return simulate(tr, prof, LoadSpec(mode="closed", concurrency=len(prompts)))


def test_newest_request_is_preempted_and_recomputed(tmp_path) -> None:
    a, b = list(range(100, 108)), list(range(200, 208))
    sim = _run(tmp_path, [a, b], 6, preemption=True)
    r = sim.result
    assert r.counters["preemptions"] == 1
    assert r.ttft_s.tolist() == pytest.approx([1.0, 1.0])
    assert r.e2e_s.tolist() == pytest.approx([6.0, 7.0])
    assert r.steps == 7
    assert sim.summary["requests_ok"] == 2


def test_reserving_the_output_at_admission_queues_instead(tmp_path) -> None:
    a, b = list(range(100, 108)), list(range(200, 208))
    sim = _run(tmp_path, [a, b], 6, preemption=False)
    r = sim.result
    assert r.counters["preemptions"] == 0
    assert r.ttft_s.tolist() == pytest.approx([1.0, 7.0])
    assert r.e2e_s.tolist() == pytest.approx([6.0, 12.0])


def test_a_request_that_alone_outgrows_the_pool_fails(tmp_path) -> None:
    # 8 prompt + 19 decoded tokens = 27 > 24: at step 18 (context 25) it needs a 7th block, nobody to preempt
    sim = _run(tmp_path, [list(range(100, 108))], 20, preemption=True)
    assert sim.result.counters["failed_admission"] == 1
    assert sim.summary["requests_ok"] == 0 and sim.summary["requests_failed"] == 1
