"""The simulator's results are pinned: seeded workloads through every path (raw Mooncake with one
and with several units per chunk, a generated companion workload in closed loop, LRU and cost
eviction, RAM / SSD / shared tiers, preemption on and off, promotions, a 3-machine cluster)
must give exactly the summary and per-request arrays recorded in ``data/sim_golden.json``.

The golden file was written by the simulator *before* its speed work (commit 45f4acd),
so an optimisation that changes any eviction, hit, step or timing shows up here. Regenerate
only for an intended model change: ``python tests/unit/test_sim_golden.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np

from kvtier.sim.cluster import simulate_cluster
from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile
from kvtier.sim.run import simulate
from kvtier.sim.trace import load_mooncake_raw, load_workload_trace
from kvtier.workload.companion import CompanionSpec, generate_companion
from kvtier.workload.format import write_workload

GOLDEN = Path(__file__).parent / "data" / "sim_golden.json"
MB = 10**6


def _mooncake(path: Path, n: int = 1500, blocks: int = 8, prefixes: int = 150, seed: int = 3) -> Path:
    """Zipf-shared prefixes + unique tails (benchmarks/sim/bench_speed.py's generator, small)."""
    rng = random.Random(seed)
    pool = [[(p << 20) | j for j in range(rng.randrange(1, blocks))] for p in range(prefixes)]
    weights = [1.0 / (i + 1) for i in range(prefixes)]
    nxt, t = 1 << 40, 0.0
    lines = []
    for c in rng.choices(range(prefixes), weights, k=n):
        pre = pool[c][:blocks - 1]
        k = max(1, blocks + rng.randrange(-blocks // 4, blocks // 4 + 1) - len(pre))
        ids = pre + list(range(nxt, nxt + k))
        nxt += k
        t += rng.expovariate(3.0) * 1000
        lines.append(json.dumps({"timestamp": int(t), "input_length": len(ids) * 512 - rng.randrange(400),
                                 "output_length": rng.randrange(2, 200), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _engine(kv_tokens: int, preemption: bool = True, block: int = 16) -> EngineProfile:
    return EngineProfile(block_size=block, max_num_batched_tokens=2048, max_num_seqs=32, kv_cache_tokens=kv_tokens,
                         preemption=preemption, step_overhead_s=0.004, prefill_token_s=4e-5, prefill_attn_s=2e-10,
                         decode_seq_s=2e-5, decode_ctx_s=5e-8, request_overhead_s=0.002)


def _prof(chunk: int, kv_tokens: int, ram: int, ssd: int = 0, shared: int = 0, eviction: str = "lru",
          preemption: bool = True, promote: int = 2) -> SimProfile:
    return SimProfile(kv_bytes_per_token=2000, chunk_size=chunk, eviction=eviction, promote_min_hits=promote,
                      engine=_engine(kv_tokens, preemption),
                      ram=TierProfile(capacity=ram, read_bw=20e9, op_latency_s=2e-5, chunk_latency_s=1e-6),
                      ssd=TierProfile(capacity=ssd, read_bw=5e9, op_latency_s=1e-4, chunk_latency_s=5e-6),
                      shared=TierProfile(capacity=shared, read_bw=2e9, op_latency_s=5e-4, chunk_latency_s=1e-5))


def _digest(res) -> str:
    h = hashlib.sha256()
    for a in (res.sent, res.ok, res.send_s, res.ttft_s, res.e2e_s, res.cached_tokens, res.load_s,
              *(res.tier_tokens[k] for k in sorted(res.tier_tokens))):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _summary(sim) -> dict:
    return json.loads(json.dumps({"summary": sim.summary, "arrays": _digest(sim.result)}, sort_keys=True,
                                 default=float))


def cases(tmp: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    mc = _mooncake(tmp / "mc.jsonl")
    tr1 = load_mooncake_raw(mc)                          # unit 512 tokens = one chunk
    tr8 = load_mooncake_raw(mc, scale=8)                 # unit 64 tokens, chunk 256 = 4 units
    trace = LoadSpec(mode="trace")
    runs = {
        "mooncake-lru-ram-ssd": (tr1, _prof(512, 40 * 512, 30 * 512 * 2000, 300 * 512 * 2000)),
        "mooncake-cost-ram": (tr1, _prof(512, 40 * 512, 60 * 512 * 2000, eviction="cost")),
        "mooncake-all-tiers-nopreempt": (tr1, _prof(512, 40 * 512, 20 * 512 * 2000, 80 * 512 * 2000,
                                                    400 * 512 * 2000, preemption=False, promote=1)),
        "mooncake-4-units-per-chunk": (tr8, _prof(256, 300 * 64, 100 * 256 * 2000, 900 * 256 * 2000)),
        "mooncake-vanilla": (tr1, _prof(512, 40 * 512, 0).model_copy(update={"save": False})),
    }
    for name, (tr, p) in runs.items():
        out[name] = _summary(simulate(tr, p, trace))
    spec = CompanionSpec(conversations=40, turns_mean=5, turns_max=12, personas=6, system_tokens=600,
                         user_tokens=40, assistant_tokens=100, max_prompt_tokens=5000, resume_fraction=0.3,
                         think_time_s=3.0, seed=11)
    wp = tmp / "companion.jsonl"
    write_workload(wp, *generate_companion(spec))
    comp = load_workload_trace(wp, unit_tokens=16, tokenizer=None)
    closed = LoadSpec(mode="closed", concurrency=12)
    out["companion-closed-ram-ssd"] = _summary(simulate(comp, _prof(256, 6000, 10 * MB, 60 * MB), closed))
    out["companion-closed-ram-cost"] = _summary(simulate(comp, _prof(256, 6000, 20 * MB, eviction="cost"), closed))
    cl = simulate_cluster(tr1, _prof(512, 40 * 512, 20 * 512 * 2000, 100 * 512 * 2000), trace, 3, 200 * 512 * 2000)
    out["cluster-3-shared"] = json.loads(json.dumps(cl.__dict__, sort_keys=True, default=float))
    return out


def test_simulator_results_equal_the_recorded_golden_ones(tmp_path) -> None:
    want = json.loads(GOLDEN.read_text())
    got = cases(tmp_path)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name
    # the golden runs exercise what they claim to (evictions in every tier, promotions, preemption)
    c = want["mooncake-lru-ram-ssd"]["summary"]["sim_counters"]
    assert c["ram_evictions"] > 0 and c["ssd_evictions"] > 0 and c["promotions"] > 0 and c["preemptions"] > 0
    c = want["mooncake-all-tiers-nopreempt"]["summary"]["sim_counters"]
    assert c["shared_evictions"] > 0 and c["preemptions"] == 0
    assert want["companion-closed-ram-ssd"]["summary"]["sim_counters"]["ram_evictions"] > 0


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        GOLDEN.write_text(json.dumps(cases(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
