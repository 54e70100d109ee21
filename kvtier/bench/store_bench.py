"""``kvtier bench store``: store throughput/latency per tier against raw limits measured in the same run.

Per model chunk size (default model: 23,040 B/token x 256 tokens; 7B-class: 57,344 B/token):

* memory: ``MemoryTier`` put / ``get_into`` (reused, pre-faulted output buffer) vs a
  plain memcpy of the same bytes from a pre-faulted slab into the same buffer.
* disk: per variant (``direct``: O_DIRECT reads and writes, the headline; ``direct_async``: the
  same, put through the writer pool as ``TieredStore.put`` does; ``direct_write``: O_DIRECT writes,
  buffered reads; ``buffered``), ``DiskTier`` put and ``get_into`` against the CEILING of plain I/O
  of the same bytes on the same files at the tier's own concurrency, O_DIRECT choice, page-cache
  state and buffer reuse, measured interleaved in the same round (``store_bench_disk``): the
  ceiling is the best (max) of the plain variants, so the ratio is the tier's cost against the
  best the machine did for that work at that moment; a round where the tier beat every variant
  is reported (``rounds_above``), not hidden. Puts are timed until written back (``os.sync``).
  References beside it (other files, not ceilings): one preallocated file written and read
  sequentially in chunk-sized blocks (fio when installed), fresh files read at the tier's reads
  in flight. The headline also reads its files with one read per chunk and reports their layout
  (FIEMAP); ``verify``: the checksum's speed on one core.
* lookup: ``TieredStore.lookup`` of a 32K-token prompt (128 chunks) held on disk and in RAM,
  with warm metadata (median of repeated lookups) and cold metadata (the first lookup after the
  store is reopened with the kernel's dentry/inode caches dropped: ``/proc/sys/vm/drop_caches``
  as root, else noted), and key hashing separately.
* The machine notes whether the disk is virtual (virtio / Xen): its O_DIRECT reads bypass this
  guest's page cache but may still be served from the HOST's cache, above the device's speed.

Statistics: the disk of a VM varies run to run and within a minute (2x here), so every figure
is taken in ``repeat`` rounds, and inside a round the tier and its plain-I/O variants alternate
block by block (writes) and file by file (reads). The report gives per-figure medians with
min/max, and each ratio as the median of the per-round ratios (``*_vs_*``) next to the ratio of
the medians.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvtier.bench.store_bench_disk import bench_disk_rounds
from kvtier.bench.store_bench_files import machine
from kvtier.bench.store_bench_lookup import bench_lookup, bench_recovery
from kvtier.bench.store_bench_memory import bench_memory
from kvtier.bench.store_bench_report import targets
from kvtier.bench.store_bench_rounds import HEADLINE, MODELS, TOKENS, VARIANTS


def run(path: Path, volume: int, quick: bool, log=print, repeat: int = 5, variants: list[str] | None = None,
        recovery_chunks: int | None = None, lookup_reps: int = 200) -> dict:
    variants = list(variants or VARIANTS)
    if HEADLINE not in variants:
        variants.insert(0, HEADLINE)
    path.mkdir(parents=True, exist_ok=True)
    info = machine(path)
    if info["fs_type"] == "tmpfs":
        log(f"warning: {path} is on tmpfs: disk figures measure RAM, not an SSD")
    t_start = time.perf_counter()
    result: dict = {"machine": info, "volume_bytes": volume, "quick": quick, "repeat": repeat,
                    "headline_variant": HEADLINE, "models": {}}
    for name, per_token in MODELS.items():
        chunk = per_token * TOKENS
        n = max(4, volume // chunk)
        log(f"[{name}] chunk {chunk / 2**20:.2f} MiB x {n} chunks, {repeat} rounds")
        mem = bench_memory(chunk, min(n, max(4, (1 << 30) // chunk)), repeat, passes=1 if quick else 2)
        disk = bench_disk_rounds(path, chunk, n, repeat, variants, log=log)
        result["models"][name] = {"chunk_bytes": chunk, "memory": mem, "disk": disk}
        g, p = disk["get_vs_raw_read"], disk["put_vs_raw_write"]
        log(f"  memory get {mem['get_gbps']:.2f} GB/s = {mem['get_vs_memcpy']['median']:.2f}x memcpy "
            f"{mem['memcpy_gbps']:.2f} (target >= 0.5x); put {mem['put_gbps']:.2f} GB/s vs memcpy into slots "
            f"{mem['memcpy_put_gbps']:.2f}; get p50/p99 {mem['get']['p50_ms']}/{mem['get']['p99_ms']} ms")
        log(f"  disk ({HEADLINE}) get {disk['get_gbps']:.2f} GB/s = {g['median']:.2f}x raw read "
            f"{disk['raw_read_gbps']:.2f} [rounds {g['min']:.2f}-{g['max']:.2f}] (target >= 0.9x); put "
            f"{disk['put_gbps']:.2f} GB/s = {p['median']:.2f}x raw write {disk['raw_write_gbps']:.2f} "
            f"[rounds {p['min']:.2f}-{p['max']:.2f}] (target >= 0.9x); raw = best plain I/O of the same files")
        for v, d in disk["variants"].items():
            if v != HEADLINE:
                log(f"  disk ({v}) get {d['get_gbps']:.2f} = {d['get_vs_raw_read']['median']:.2f}x, put "
                    f"{d['put_gbps']:.2f} = {d['put_vs_raw_write']['median']:.2f}x")
    lk = bench_lookup(path, lookup_reps)
    log(f"lookup 128 chunks: disk {lk['lookup_disk_ms_128_chunks']} ms, memory {lk['lookup_memory_ms_128_chunks']} ms"
        f" (target <= 1 ms); key hashing 32K tokens: {lk['keys_ms_32k_tokens_numpy']} ms (numpy), "
        f"{lk['keys_ms_32k_tokens_list']} ms (list)")
    rec = bench_recovery(path, recovery_chunks or (10_000 if quick else 100_000))
    result["index_recovery"] = rec
    log(f"index recovery of {rec['chunks']} chunks: {rec['open_s_no_manifest']} s reading every header, "
        f"{rec['open_s_with_manifest']} s with the manifest")
    d = result["models"]["default"]
    result.update({"memory": d["memory"], "disk": d["disk"], **lk})
    result["targets"] = targets(result)
    result["duration_s"] = round(time.perf_counter() - t_start, 1)
    return result
