"""Simulator speed: requests per second on big traces (not a unit test; prints rates and ratios).

Cases (each: load + simulate + summarize, wall time; baseline in the same run = parsing the
same file with json.loads alone, the floor of any simulator that reads it):
1. the 3,993-request Mooncake trace in ../shared/data (trace mode, h100/llama-3-8b, RAM 64 GiB, SSD 2 TiB);
2. 12,000 requests with ~12K-token prompts (synthetic Mooncake-style: 24 hash ids of 512 tokens,
   Zipf-shared prefixes), trace mode;
3. 1,000,000 requests of the same generator with ~4K-token prompts (--million-blocks).
Run: python benchmarks/sim/bench_speed.py [--json OUT] [--skip-million]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from kvtier.sim.load import LoadSpec
from kvtier.sim.presets import resolve_profile
from kvtier.sim.run import simulate
from kvtier.sim.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]
# ../shared/data relative to the main checkout (worktrees live one level deeper)
MOONCAKE = next((p / "shared" / "data" / "mooncake_synthetic_trace.jsonl" for p in (ROOT.parent, ROOT.parent.parent)
                 if (p / "shared" / "data" / "mooncake_synthetic_trace.jsonl").is_file()),
                ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl")


def gen_trace(path: Path, n: int, blocks: int, rate: float, prefixes: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    pool = [[(p << 20) | j for j in range(rng.randrange(1, blocks))] for p in range(prefixes)]
    weights = [1.0 / (i + 1) for i in range(prefixes)]
    nxt = 1 << 40
    t = 0.0
    with path.open("w") as fh:
        chosen = rng.choices(range(prefixes), weights, k=n)
        for i in range(n):
            pre = pool[chosen[i]][:blocks - 1]
            k = max(1, blocks + rng.randrange(-blocks // 4, blocks // 4 + 1) - len(pre))
            ids = pre + list(range(nxt, nxt + k))
            nxt += k
            t += rng.expovariate(rate) * 1000
            fh.write(json.dumps({"timestamp": int(t), "input_length": len(ids) * 512 - rng.randrange(400),
                                 "output_length": rng.randrange(20, 400), "hash_ids": ids}) + "\n")


def parse_only(path: Path) -> float:
    t = time.perf_counter()
    with path.open() as fh:
        for line in fh:
            json.loads(line)
    return time.perf_counter() - t


def case(name: str, path: Path, profile: str, ram: str, ssd: str) -> dict:
    from kvtier.config import parse_size
    load0 = os.getloadavg()[0]
    base = parse_only(path)
    prof = resolve_profile(profile)
    prof.ram.capacity, prof.ssd.capacity = parse_size(ram), parse_size(ssd)
    t0, c0 = time.perf_counter(), time.process_time()
    tr = load_trace(path, unit_tokens=prof.engine.block_size)
    t1 = time.perf_counter()
    marks = [tr.num_requests * i // 10 for i in range(1, 10)] if tr.num_requests >= 100_000 else []

    def progress(done: int) -> None:         # a line per 10% on long runs (a rate even if cut short)
        while marks and done >= marks[0]:
            dt = time.perf_counter() - t1
            print(f"  {name}: {marks.pop(0)} requests simulated in {dt:.1f} s ({done / dt:.0f}/s; "
                  f"after {t1 - t0:.1f} s of loading)", flush=True)
    sim = simulate(tr, prof, LoadSpec(mode="trace"), progress=progress if marks else None)
    t2 = time.perf_counter()
    s = sim.summary
    out = {"case": name, "requests": tr.num_requests, "mean_prompt_tokens": float(tr.prompt_tokens.mean()),
           "load_s": t1 - t0, "simulate_s": t2 - t1, "total_s": t2 - t0, "parse_only_s": base,
           "requests_per_s": tr.num_requests / (t2 - t0), "total_over_parse": (t2 - t0) / base,
           "token_hit_rate": s["token_hit_rate"], "ttft_mean_s": s["ttft_mean_s"], "steps": sim.result.steps,
           "load_avg_1min_start": load0, "load_avg_1min_end": os.getloadavg()[0],
           "cpu_s": time.process_time() - c0}
    print(f"{name}: {tr.num_requests} requests (mean prompt {out['mean_prompt_tokens']:.0f} tokens): "
          f"{out['total_s']:.2f} s total (load {out['load_s']:.2f} s, simulate {out['simulate_s']:.2f} s) = "
          f"{out['requests_per_s']:.0f} requests/s; {out['total_over_parse']:.1f}x the time json.loads alone takes "
          f"({base:.2f} s); hit rate {s['token_hit_rate']:.1%}, mean TTFT {s['ttft_mean_s']:.3f} s; CPU {out['cpu_s']:.1f} s, "
          f"load average {load0:.2f} -> {out['load_avg_1min_end']:.2f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-million", action="store_true")
    ap.add_argument("--million", type=int, default=1_000_000)
    ap.add_argument("--million-blocks", type=int, default=8)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        if MOONCAKE.is_file():
            rows.append(case("mooncake-3993", MOONCAKE, "h100/llama-3-8b", "64GiB", "2TiB"))
        p12 = Path(d) / "t12k.jsonl"
        gen_trace(p12, 12_000, 24, rate=2.0)
        rows.append(case("12k-requests-12k-tokens", p12, "h100/llama-3-8b", "64GiB", "2TiB"))
        if not args.skip_million:
            pm = Path(d) / "t1m.jsonl"
            gen_trace(pm, args.million, args.million_blocks, rate=12.0, prefixes=20000)
            rows.append(case(f"{args.million}-requests", pm, "h200/llama-3-8b", "256GiB", "8TiB"))
    info = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(), "rows": rows}
    try:
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                           if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if args.json:
        args.json.write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
