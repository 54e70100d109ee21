"""Shared-fs tier on a real JuiceFS volume (Valkey metadata, local-dir data, two mounts).

    .venv/bin/python benchmarks/sharedfs/juicefs_bench.py \
        --json benchmarks/results/sharedfs/<date>-<cpu-class>/juicefs.json

1. Lookup of a 32K-token prompt (256 chunks of 128 tokens) from a mount that did not write it:
   * cold: the first lookup on a freshly mounted client (empty kernel and client caches);
   * warm: repeated at once (kernel attribute/entry cache, 1 s by default);
   * expired: 1.5 s later (every stat is a metadata round trip to Valkey again);
   each with the tier's parallel stats (32 threads) and serially (1 thread), same run.
2. ``kvtier bench store`` sharedfs rows: written through mount a, read through mount b, tier vs
   raw I/O of the same bytes at the same concurrency (store_bench_sharedfs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import CHAIN, chains, cpu_name, juicefs_volume, open_tier, summary, time_lookups

from kvtier.bench.store_bench_sharedfs import bench_sharedfs, markdown_rows
from kvtier.chunk import ChunkMeta
from kvtier.tiers.protocol import WriteItem


def write_chains(tier, all_chains: list[list[bytes]]) -> None:
    payload = memoryview(bytes(64))
    for c in all_chains:
        items = [WriteItem(ChunkMeta(k, c[i - 1] if i else None, 128, (64,), "uint8", 64), payload)
                 for i, k in enumerate(c)]
        assert all(tier.write(items))
        assert tier.flush(120)


def lookups(fs, n_chains: int, reps: int) -> dict:
    a = fs.mount("writer")
    (a.path / "kv").mkdir()
    tw = open_tier(a.path / "kv")
    cs = chains(n_chains * CHAIN, seed=7)
    write_chains(tw, cs)
    tw.close()
    out: dict = {}
    for threads in (32, 1):
        cold, warm, expired = [], [], []
        for r in range(reps):
            m = fs.mount(f"reader-{threads}-{r}")            # a fresh client: nothing cached
            t = open_tier(m.path / "kv", lookup_threads=threads)
            time_lookups(t, [cs[(r + 1) % len(cs)][:1]])    # start the pool (1 other chunk)
            keys = cs[r % len(cs)]
            cold += time_lookups(t, [keys])
            warm += time_lookups(t, [keys] * 5)
            time.sleep(1.5)
            expired += time_lookups(t, [keys])
            t.close()
            m.umount()
        out[f"threads_{threads}"] = {"cold": summary(cold), "warm": summary(warm), "expired": summary(expired)}
        print(f"lookup 256 chunks, {threads} thread(s): cold {out[f'threads_{threads}']['cold']}, "
              f"warm {out[f'threads_{threads}']['warm']}, expired {out[f'threads_{threads}']['expired']}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--volume-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-store", action="store_true")
    ap.add_argument("--skip-lookup", action="store_true")
    ap.add_argument("--block", type=int, default=8, help="chunks per interleaved raw/tier block")
    a = ap.parse_args()
    print(f"# CPU: {cpu_name()}", flush=True)
    result: dict = {"cpu": cpu_name()}
    with juicefs_volume() as (fs, _meta):
        if not a.skip_lookup:
            result["lookup_256"] = lookups(fs, 8, a.reps)
        if not a.skip_store:
            w, r = fs.mount("a"), fs.mount("b")
            (w.path / "bench").mkdir()
            while not (r.path / "bench").exists():
                time.sleep(0.05)
            result["sharedfs"] = bench_sharedfs(w.path / "bench", r.path / "bench", volume=a.volume_mib << 20,
                                                threads=a.threads, repeat=a.rounds, block=a.block)
            print("\n".join(markdown_rows(result["sharedfs"])), flush=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
