"""Projection of a kvtier cluster to 8, 32 and 128 replicas on the public Mooncake trace (pure simulation).

Every replica is the preset GPU machine (``--profile``, default h100/llama-3-8b) with private
kvtier tiers (``--memory-capacity`` RAM, ``--disk-capacity`` NVMe per replica); the cluster is
one load behind a router (``kvtier.sim.cluster.run_cluster``): roundrobin and kv-aware routing,
each with vanilla vLLM (its prefix cache only), kvtier local tiers only, and local tiers + one
shared tier (the preset's shared store; sized from the scaled trace's own miss-ratio curve: the
smallest capacity reaching ``--shared-target`` of the ideal hit rate).

Load scaling (the trace has 3,993 requests over ~17 minutes; ``--base`` replicas serve it at its
own timestamps): N replicas get the same per-replica request rate.

* ``copies`` (default): K = N / base copies of the trace, each with its own hash ids (copy k's ids
  are offset by k x (largest id + 1): K independent user populations, nothing shared between
  copies, a conservative case for the shared tier), copy k's timestamps shifted by k/K of the
  mean gap between requests so the copies interleave. Requests, unique chunks and the shared
  tier's capacity grow K-fold; per-replica rate and working set stay.
* ``time``: the same 3,993 requests with timestamps x base / N (the same content, K-fold the
  rate: each replica sees fewer requests, and reuse comes K-fold sooner).

Output (``--out``): projection.json (every run) and projection.md (the table, the machine, the
options). Figures are simulated; the simulator ran on the machine named there.
Run: python benchmarks/cluster/project.py [--scaling copies,time] [--replicas 8,32,128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtier.config import parse_size  # noqa: E402
from kvtier.sim.cluster import run_cluster  # noqa: E402
from kvtier.sim.load import LoadSpec  # noqa: E402
from kvtier.sim.planner import auto_sample_rate, peak_shared_bw  # noqa: E402
from kvtier.sim.presets import resolve_profile  # noqa: E402
from kvtier.sim.stackdist import access_stream, miss_ratio_curve  # noqa: E402
from kvtier.sim.trace import load_trace  # noqa: E402

TRACE = ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
OUT = ROOT / "benchmarks" / "results" / "cluster-projection" / "2026-12-04-avx2"
LONG = 20_000          # "long document" prompts: more than this many tokens


def copies_trace(src: Path, k: int, dst: Path) -> Path:
    """``k`` interleaved copies of a raw Mooncake trace with disjoint hash ids (module docstring)."""
    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    top = max(max(r["hash_ids"], default=0) for r in rows) + 1
    ts = [r["timestamp"] for r in rows]
    gap = (max(ts) - min(ts)) / max(1, len(rows) - 1)
    out = []
    for c in range(k):
        for r in rows:
            out.append({"timestamp": r["timestamp"] + c * gap / k, "input_length": r["input_length"],
                        "output_length": r["output_length"], "hash_ids": [h + c * top for h in r["hash_ids"]]})
    out.sort(key=lambda r: r["timestamp"])
    dst.write_text("".join(json.dumps(r) + "\n" for r in out))
    return dst


def curve_point(trace, prof, target: float) -> tuple[float, int, int]:
    """(ideal hit rate, bytes reaching ``target`` x ideal, bytes of every distinct chunk)."""
    chunk_tokens = max(1, prof.chunk_size // trace.unit_tokens) * trace.unit_tokens
    chunk_bytes = chunk_tokens * prof.kv_bytes_per_token
    s = access_stream(trace, prof.chunk_size)
    mrc = miss_ratio_curve(s, chunk_bytes, auto_sample_rate(len(s.keys)))
    knee = mrc.smallest_reaching(target)
    return mrc.ideal_hit_rate, int((knee or 0) * chunk_bytes), int(len(np.unique(s.keys)) * chunk_bytes)


def row(trace, prof, load, n: int, routing: str, config: str) -> dict:
    t0 = time.time()
    r = run_cluster(trace, prof, load, n, routing)
    ok = r.result.ok
    long_m = ok & (trace.prompt_tokens > LONG)
    per = [p.requests for p in r.per_replica]
    computed = int((trace.prompt_tokens[ok] - r.result.cached_tokens[ok]).sum())
    return {"replicas": n, "routing": routing, "config": config, "requests": r.requests, "failed": r.failed,
            "token_hit_rate": r.token_hit_rate, "ttft_mean_s": r.ttft_mean_s, "ttft_p90_s": r.ttft_p90_s,
            "ttft_mean_long_s": float(r.result.ttft_s[long_m].mean()) if long_m.any() else None,
            "long_requests": int(long_m.sum()), "tier_hit_rate": r.tier_hit_rate,
            "shared_capacity_bytes": int(prof.shared.capacity), "shared_bytes_read": r.shared_bytes_read,
            "shared_read_bw": r.shared_read_bw, "shared_read_bw_per_replica": r.shared_read_bw / n,
            "shared_read_bw_peak": peak_shared_bw(r.result, prof.kv_bytes_per_token, r.duration_s),
            # what write-through stores at most: every computed prompt token once (full chunks only in fact)
            "computed_bytes_per_s": computed * prof.kv_bytes_per_token / r.duration_s if r.duration_s else 0.0,
            "requests_per_replica_min_max": [min(per), max(per)], "duration_s": r.duration_s,
            "wall_s": round(time.time() - t0, 1)}


def gb(v: float | None) -> str:
    return "–" if v is None else f"{v / 1e9:.3g}"


def tib(v: float) -> str:
    return f"{v / 2**40:.3g}"


def scaling_note(scaling: str, base: int, requests: int) -> str:
    if scaling == "copies":
        return (f"{base} replicas serve the trace at its own timestamps; N replicas get N/{base} interleaved copies "
                "of it with disjoint hash ids (same per-replica rate and working set, nothing shared between copies)")
    return f"the same {requests:,} requests at timestamps x {base}/N (same per-replica rate, the same content)"


def table(rows: list[dict], meta: dict) -> list[str]:
    out = ["| replicas | routing | config | requests | hit rate (ideal) | vLLM / RAM / SSD / shared | TTFT mean (s) | "
           "TTFT p90 (s) | TTFT mean >20K tok (s) | shared cap (TiB) | shared read GB/s: mean (peak) | "
           "per replica GB/s: mean (peak) | writes GB/s (at most) |", "|---" * 13 + "|"]
    for r in rows:
        t = r["tier_hit_rate"]
        ideal = meta["ideal"][f"{r['scaling']}/{r['replicas']}"]
        sh = r["config"] == "shared"
        n = r["replicas"]
        out.append(
            f"| {n} | {r['routing']} | {r['config']} | {r['requests']} | {r['token_hit_rate']:.1%} "
            f"({ideal:.1%}) | {t['gpu']:.1%} / {t['ram']:.1%} / {t['ssd']:.1%} / {t['shared']:.1%} | "
            f"{r['ttft_mean_s']:.3f} | {r['ttft_p90_s']:.3f} | "
            f"{'–' if r['ttft_mean_long_s'] is None else format(r['ttft_mean_long_s'], '.3f')} | "
            f"{tib(r['shared_capacity_bytes']) if sh else '–'} | "
            f"{gb(r['shared_read_bw']) + ' (' + gb(r['shared_read_bw_peak']) + ')' if sh else '–'} | "
            f"{gb(r['shared_read_bw'] / n) + ' (' + gb(r['shared_read_bw_peak'] / n) + ')' if sh else '–'} | "
            f"{gb(r['computed_bytes_per_s']) if sh else '–'} |")
    out += ["", "TTFT mean of vanilla and of local-only over local+shared (same replicas, same routing):", "",
            "| replicas | routing | vanilla / shared (all) | vanilla / shared (>20K tok) | local / shared (all) | "
            "local / shared (>20K tok) |", "|---|---|---|---|---|---|"]
    key = {(r["replicas"], r["routing"], r["config"]): r for r in rows}

    def q(a: dict | None, b: dict, f: str) -> str:
        return "–" if a is None or a[f] is None or not b[f] else f"{a[f] / b[f]:.2f}x"
    for (n, routing, cfg), r in key.items():
        if cfg == "shared":
            v, lo = key.get((n, routing, "vanilla")), key.get((n, routing, "local"))
            out.append(f"| {n} | {routing} | {q(v, r, 'ttft_mean_s')} | {q(v, r, 'ttft_mean_long_s')} | "
                       f"{q(lo, r, 'ttft_mean_s')} | {q(lo, r, 'ttft_mean_long_s')} |")
    return out


def render(rows: list[dict], meta: dict) -> str:
    m = meta["machine"]
    out = [f"# Cluster projection: Mooncake trace, {meta['profile']}", "",
           f"Simulated (`{meta['command']}`, {meta['wall_s']:.0f} s wall in all) on "
           f"{m.get('cpu', '?')} ({m.get('cpu_capability', '?')}, {m.get('cpus', '?')} vCPU). Per replica: RAM "
           f"{meta['memory_capacity']}, NVMe {meta['disk_capacity']}, vLLM KV cache {meta['kv_cache_tokens']:,} "
           f"tokens; the shared tier (when on) is sized from each scaled trace's own miss-ratio curve at "
           f"{meta['shared_target']:.0%} of its ideal hit rate. Peak = the busiest of 100 windows of the run "
           "(shared-tier tokens counted at each request's first token). Writes (at most): the computed prompt "
           "tokens' KV bytes per second, what write-through sends the shared tier (only full chunks in fact). The "
           "model has no network contention: each reader gets the shared store's per-client bandwidth.", ""]
    for scaling in meta["scalings"]:
        sel = [r for r in rows if r["scaling"] == scaling]
        note = scaling_note(scaling, meta["base"], meta["trace_requests"])
        out += [f"## Load scaling: {scaling}", "", note + ".", ""] + table(sel, meta) + [""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--profile", default="h100/llama-3-8b")
    ap.add_argument("--replicas", default="8,32,128")
    ap.add_argument("--base", type=int, default=8, help="replicas that serve the trace at its own timestamps")
    ap.add_argument("--scaling", default="copies,time", help="copies and/or time (comma-separated)")
    ap.add_argument("--memory-capacity", default="64GiB")
    ap.add_argument("--disk-capacity", default="1TiB")
    ap.add_argument("--shared-target", type=float, default=0.95)
    ap.add_argument("--routing", default="roundrobin,kv-aware")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from kvtier.bench.ttft_report import machine_description
    base_prof = resolve_profile(args.profile)
    base_prof.ram.capacity, base_prof.ssd.capacity = parse_size(args.memory_capacity), parse_size(args.disk_capacity)
    sizes = [int(x) for x in args.replicas.split(",")]
    scalings = args.scaling.split(",")
    if not set(scalings) <= {"copies", "time"}:
        raise SystemExit(f"--scaling: copies and/or time, got {args.scaling!r}")
    if "copies" in scalings and any(n % args.base for n in sizes):
        raise SystemExit(f"--replicas must be multiples of --base {args.base} with copies scaling")
    rows, ideal, t_all = [], {}, time.time()
    with tempfile.TemporaryDirectory() as d:
        for scaling, n in ((s, n) for s in scalings for n in sizes):
            k = max(1, n // args.base)
            if scaling == "copies":
                path = copies_trace(args.trace, k, Path(d) / f"x{k}.jsonl") if k > 1 else args.trace
                tr, load = load_trace(path, unit_tokens=16), LoadSpec(mode="trace")
            else:
                tr, load = load_trace(args.trace, unit_tokens=16), LoadSpec(mode="trace", time_scale=args.base / n)
            ideal_hr, need, every = curve_point(tr, base_prof, args.shared_target)
            ideal[f"{scaling}/{n}"] = ideal_hr
            for routing, config in ((r, c) for r in args.routing.split(",") for c in ("vanilla", "local", "shared")):
                p = base_prof.model_copy(deep=True)
                p.shared.capacity = need if config == "shared" else 0
                p.save = config != "vanilla"
                r = row(tr, p, load, n, routing, config) | {"scaling": scaling, "distinct_chunk_bytes": every}
                rows.append(r)
                print(f"{scaling:6s} {n:4d} {routing:10s} {config:8s} hit {r['token_hit_rate']:.3f} ttft "
                      f"{r['ttft_mean_s']:.3f} p90 {r['ttft_p90_s']:.3f} shared bw {r['shared_read_bw'] / 1e9:.2f} "
                      "GB/s "
                      f"wall {r['wall_s']} s", flush=True)
    argv = [a if not a.startswith(str(ROOT)) else os.path.relpath(a, ROOT) for a in sys.argv[1:]]
    meta = {"machine": machine_description(), "profile": base_prof.description, "scalings": scalings,
            "command": " ".join(["python benchmarks/cluster/project.py", *argv]),
            "base": args.base, "memory_capacity": args.memory_capacity, "disk_capacity": args.disk_capacity,
            "kv_cache_tokens": base_prof.engine.kv_cache_tokens, "shared_target": args.shared_target, "ideal": ideal,
            "trace": args.trace.name, "wall_s": time.time() - t_all,
            "trace_requests": sum(1 for x in args.trace.read_text().splitlines() if x.strip())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "projection.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "projection.md").write_text(render(rows, meta))
    print(render(rows, meta))


if __name__ == "__main__":
    main()
