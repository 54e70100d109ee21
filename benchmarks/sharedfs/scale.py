"""Lookup latency and one janitor eviction pass vs the number of chunk files.

    .venv/bin/python benchmarks/sharedfs/scale.py --local /tmp/sfs-scale \
        --files 10000 100000 1000000
    .venv/bin/python benchmarks/sharedfs/scale.py --juicefs --files 10000 100000

Files are sparse (64-byte payload, 4,180 bytes apparent size, no data blocks): the metadata is
what is measured. Populations grow in place (10k, then 90k more, ...); the directory is removed
at the end. Per size: p50/p99 of 50 lookups of a whole 256-chunk chain (a 32K-token prompt at
128 tokens per chunk) through ``SharedFsTier.longest_prefix`` (32 parallel stat threads) and
with 1 thread (serial baseline, same run), then one janitor pass with capacity = 95% of usage
(low watermark 0.9: ~15% of the files are evicted, oldest chains first).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

from common import CHAIN, SIZE, chains, cpu_name, juicefs_volume, open_tier, populate, summary, time_lookups

from kvtier.config import SharedFsConfig
from kvtier.metrics import Telemetry
from kvtier.tiers.sharedfs.janitor import Janitor
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.sharedfs.layout import TIER


def measure(base: Path, sizes: list[int], threads: int, label: str) -> list[dict]:
    rows = []
    all_chains: list[list[bytes]] = []
    for target in sizes:
        new = chains(target - len(all_chains) * CHAIN, seed=len(all_chains) + 1)
        pop_s = populate(base, new, threads)
        all_chains += new
        n_files = len(all_chains) * CHAIN
        rng = random.Random(0)
        sample = [all_chains[rng.randrange(len(all_chains))] for _ in range(50)]
        par = open_tier(base)
        ser = open_tier(base, lookup_threads=1)
        time_lookups(par, sample[:3])                      # start the pool's threads
        lk = time_lookups(par, sample)
        lk1 = time_lookups(ser, sample)
        par.close()
        ser.close()
        cfg = SharedFsConfig(path=base, capacity=int(n_files * SIZE * 0.95), low_watermark=0.9,
                             lease_ttl_s=3600, janitor_interval_s=60)
        tier = open_tier(base)
        j = Janitor(tier.layout, cfg, Bursts(Telemetry(), TIER), 32)
        assert j.lease.try_hold()
        t0 = time.perf_counter()
        r = j.run_pass()
        pass_s = time.perf_counter() - t0
        j.lease.release()
        tier.close()
        evicted = set()
        keep = []
        for c in all_chains:          # forget evicted chains (the oldest ones) for later lookups
            if not (Path(tier.layout.path_of(c[-1])).exists()):
                evicted.add(id(c))
            else:
                keep.append(c)
        row = {"fs": label, "files": n_files, "populate_s": round(pop_s, 1),
               "lookup_256_ms": summary(lk), "lookup_256_serial_ms": summary(lk1),
               "janitor": {"pass_s": round(pass_s, 2), "scan_s": round(r.scan_s, 2), "evict_s": round(r.evict_s, 2),
                           "scanned": r.files, "evicted": r.evicted,
                           "scan_us_per_file": round(r.scan_s / max(r.files, 1) * 1e6, 2),
                           "evict_us_per_file": round(r.evict_s / max(r.evicted, 1) * 1e6, 2)}}
        print(json.dumps(row), flush=True)
        rows.append(row)
        # refill what the janitor removed so the next size starts from the full count
        refill = populate(base, [c for c in all_chains if id(c) in evicted], threads)
        del refill
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", type=Path, help="a directory on a local filesystem (removed at the end)")
    ap.add_argument("--juicefs", action="store_true", help="a fresh two-mount JuiceFS volume (Valkey metadata)")
    ap.add_argument("--files", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if bool(a.local) == a.juicefs:
        print("error: give exactly one of --local DIR or --juicefs", file=sys.stderr)
        return 2
    print(f"# CPU: {cpu_name()}", flush=True)
    if a.local:
        if a.local.exists():
            print(f"error: {a.local} exists; give a new directory", file=sys.stderr)
            return 2
        a.local.mkdir(parents=True)
        try:
            rows = measure(a.local, sorted(a.files), 2, "local")
        finally:
            shutil.rmtree(a.local, ignore_errors=True)
    else:
        with juicefs_volume() as (fs, _meta):
            m = fs.mount("a")
            (m.path / "kv").mkdir()
            rows = measure(m.path / "kv", sorted(a.files), 16, "juicefs")
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
