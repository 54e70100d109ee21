"""Projections with GPU presets (pure simulation): a cluster sharing one shared tier.

Cluster: N = 1, 4, 16, 64 H100 machines serving Llama-3-8B (preset h100/llama-3-8b), each
with private kvtier tiers (RAM 64 GiB, NVMe SSD 1 TiB), with and without one shared tier
(Mooncake-style RDMA store, 16 TiB) on
  (a) the 3,993-request Mooncake trace at its own timestamps (the load is split N ways), and
  (b) a Mooncake-style synthetic trace (20,000 requests, Zipf-shared prefixes, ~8K tokens)
      whose arrival rate grows with N (1 request/s per machine), so per-machine load is fixed.
Run: python benchmarks/sim/projections.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speed import MOONCAKE, gen_trace  # noqa: E402

from kvtier.sim.cluster import simulate_cluster  # noqa: E402
from kvtier.sim.load import LoadSpec  # noqa: E402
from kvtier.sim.presets import resolve_profile  # noqa: E402
from kvtier.sim.trace import load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def cluster_rows(trace, name: str, per_machine_rate: bool) -> list[dict]:
    prof = resolve_profile("h100/llama-3-8b")
    prof.ram.capacity, prof.ssd.capacity = 64 * GIB, 1024 * GIB
    rows = []
    for n in (1, 4, 16, 64):
        for shared in (0, 16 * 1024 * GIB):
            t = time.time()
            load = LoadSpec(mode="trace", time_scale=1.0 / n if per_machine_rate else 1.0)
            r = simulate_cluster(trace, prof, load, n, shared)
            rows.append({"trace": name, "machines": n, "shared_tier": bool(shared), "requests": r.requests,
                         "token_hit_rate": r.token_hit_rate, "ttft_mean_s": r.ttft_mean_s,
                         "ttft_p90_s": r.ttft_p90_s, "tier_hit_rate": r.tier_hit_rate, "wall_s": time.time() - t})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def render(rows: list[dict]) -> str:
    out = ["| trace | machines | shared tier | hit rate | (vLLM / RAM / SSD / shared) | TTFT mean (s) | TTFT p90 (s) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tier_hit_rate"]
        out.append(f"| {r['trace']} | {r['machines']} | {'yes' if r['shared_tier'] else 'no'} | "
                   f"{r['token_hit_rate']:.1%} | {t['gpu']:.1%} / {t['ram']:.1%} / {t['ssd']:.1%} / {t['shared']:.1%} | "
                   f"{r['ttft_mean_s']:.3f} | {r['ttft_p90_s']:.3f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulator" / "2026-12-01-avx2" / "cluster-projection")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if MOONCAKE.is_file():
        rows += cluster_rows(load_trace(MOONCAKE, unit_tokens=16), "mooncake-3993 (own timestamps)", False)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "synthetic.jsonl"
        gen_trace(p, 20_000, 16, rate=1.0, prefixes=3000, seed=1)
        rows += cluster_rows(load_trace(p, unit_tokens=16), "synthetic 20K (1 req/s per machine)", True)
    (args.out / "cluster.json").write_text(json.dumps(rows, indent=2))
    (args.out / "cluster.md").write_text(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
