"""``kvtier bench store``: store throughput/latency per tier against raw limits measured in the same run.

Per model chunk size (default model: 23,040 B/token x 256 tokens; 7B-class: 57,344 B/token):

* memory: ``MemoryTier`` put / ``get_into`` (reused, pre-faulted output buffer) vs a
  plain memcpy of the same bytes from a pre-faulted slab into the same buffer.
* disk: ``DiskTier`` sequential put (write temp + publish, one thread, queue depth 1)
  and ``get_into`` of every chunk after the files were dropped from the page cache
  (fsync + POSIX_FADV_DONTNEED), vs raw sequential O_DIRECT write/read of the same
  volume in chunk-sized blocks, no checksum (fio when installed, else the same I/O
  done raw here). Tier variants: ``direct`` (O_DIRECT reads and writes: apples to
  apples with the raw figures, the headline), ``direct_write`` (O_DIRECT writes,
  buffered reads with kernel readahead) and ``buffered`` (page cache both ways).
  Buffered puts are timed until the data is written back (``os.sync`` inside the timed region,
  as for O_DIRECT), so the page cache cannot make a put look faster than the disk.
  A second raw read baseline runs at the tier's OWN concurrency and I/O mode
  (``rawread.best_raw_read``: fresh files, the same pieces in flight as ``get_into``, O_DIRECT
  for the O_DIRECT variants, buffered from evicted files for the buffered ones):
  ``get_vs_raw_read_same_io``. A ratio above 1 there means the baseline was not a ceiling.
  The headline variant's get is also timed against raw O_DIRECT reads of the SAME chunk files
  (open, one ``preadv`` of the whole file, close; no checksum) and against its own reads issued
  as one ``preadv`` per chunk (checksum after it), the three passes in rotating order:
  ``get_vs_raw_read_same_files`` separates what the tier's read path costs from what the files'
  placement costs (chunk files are many extents in many directories, the raw file one), and
  ``layout`` says how contiguous the chunk files were (FIEMAP). ``verify``: the checksum's
  speed on one core (the ceiling of a verified read when nothing overlaps).
* lookup: ``TieredStore.lookup`` of a 32K-token prompt (128 chunks) held on disk and in RAM,
  with warm metadata (median of repeated lookups) and cold metadata (the first lookup after the
  store is reopened with the kernel's dentry/inode caches dropped: ``/proc/sys/vm/drop_caches``
  as root, else noted), and key hashing separately.
* The machine notes whether the disk is virtual (virtio / Xen): its O_DIRECT reads bypass this
  guest's page cache but may still be served from the HOST's cache, above the device's speed.

Statistics: the disk of a VM varies run to run (2x here), so every figure is taken
in ``repeat`` rounds. In each round the raw pass and the headline tier pass run back
to back (order alternating between rounds) so both see the same disk state; the
report gives per-figure medians with min/max, and each ratio as the median of the
per-round ratios (``*_vs_*``) next to the ratio of the medians (``*_vs_*_of_medians``).
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvtier.chunk import ChunkMeta
from kvtier.compute import kv_bytes
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.bench.disk_attribution import fig, attribution_markdown, file_layout, raw_read_files, verify_speed
from kvtier.tiers import diskio
from kvtier.tiers.diskio import ALIGN, open_direct
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.protocol import WriteItem

# KV bytes per token (bf16) of the bundled SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) and of a
# 7B-class GQA model (Qwen2.5-7B: 28 layers, 4 KV heads, head_dim 128): 23,040 and 57,344 B.
MODELS = {"default": kv_bytes(30, 3, 64, 2), "7b": kv_bytes(28, 4, 128, 2)}
TOKENS = 256
GB = 1e9
# disk tier variants: name -> (o_direct writes, o_direct reads)
VARIANTS = {"direct": (True, True), "direct_async": (True, True), "direct_write": (True, False),
            "buffered": (False, False)}
WRITER_THREADS = 2          # the disk tier's default writer pool (store.disk.writer_threads)
HEADLINE = "direct"


# -- statistics ---------------------------------------------------------------------------
def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant figures: a slow medium's 0.0123 GB/s keeps its digits (3 decimals
    kept one or two, and a per-round ratio recomputed from them was off by several percent)."""
    return float(f"{x:.{digits}g}")


def spread(xs: list[float]) -> dict:
    """Median, min and max of one figure's per-round values (4 significant figures)."""
    return {"median": sig(statistics.median(xs)), "min": sig(min(xs)), "max": sig(max(xs))}


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Per-round ratios num[i]/den[i]: their median, min and max, and the ratio of the medians."""
    rs = [a / b for a, b in zip(num, den, strict=True)]
    return {**spread(rs), "of_medians": sig(statistics.median(num) / statistics.median(den))}


def order(round_index: int, first: str, second: str) -> tuple[str, str]:
    """The two back-to-back passes of a round; the order alternates between rounds."""
    return (first, second) if round_index % 2 == 0 else (second, first)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] * 1e3


def _lat(xs: list[float]) -> dict:
    return {"p50_ms": round(_pct(xs, 50), 3), "p99_ms": round(_pct(xs, 99), 3)}


# -- buffers, files -----------------------------------------------------------------------
def _aligned(n: int) -> memoryview:
    m = mmap.mmap(-1, (n + ALIGN - 1) // ALIGN * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return memoryview(m)


def _random(n: int, seed: int) -> memoryview:
    buf = _aligned(n)
    buf[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return buf[:n]


def _drop_cache(paths: list[str]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _remove(p: Path) -> None:
    """Delete a file or tree and wait until the filesystem settled: with online discard (this
    VM mounts ext4 with ``discard``) freeing 1 GiB issues discards at the next journal commit,
    which would otherwise slow whichever timed pass comes next."""
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()
    os.sync()


def _ns(chunk_bytes: int) -> Namespace:
    return Namespace("bench", f"chunk{chunk_bytes}", "bfloat16", "bench", 16, TOKENS)


# -- memory -------------------------------------------------------------------------------
def bench_memory(chunk: int, n: int, repeat: int, passes: int) -> dict:
    """memcpy vs MemoryTier, ``repeat`` rounds of (baseline, tier) passes back to back."""
    src = _random(chunk, 0)
    out = _aligned(chunk)
    slab = _aligned(chunk * n)
    for i in range(n):          # real data in the slab: the get baseline must not read the zero page
        slab[i * chunk:(i + 1) * chunk] = src
    tier = MemoryTier.open(n * ((chunk + 4095) // 4096 * 4096), prefault=True, telemetry=Telemetry())
    keys = chunk_keys(_ns(chunk), np.arange(n * TOKENS))
    metas = [ChunkMeta(k, None, TOKENS, (chunk,), "uint8", chunk) for k in keys]
    t0 = time.perf_counter()
    for m in metas:        # first fill: allocates (and with prefault populates) the slab once
        assert tier.put(m, src)
    first_fill = n * chunk / (time.perf_counter() - t0) / GB
    vol = passes * n * chunk

    def memcpy_put(_lat: list) -> float:
        t0 = time.perf_counter()
        for _ in range(passes):
            for i in range(n):
                slab[i * chunk:(i + 1) * chunk] = src
        return vol / (time.perf_counter() - t0) / GB

    def memcpy_get(_lat: list) -> float:
        t0 = time.perf_counter()
        for _ in range(passes):
            for i in range(n):
                out[:chunk] = slab[i * chunk:(i + 1) * chunk]
        return vol / (time.perf_counter() - t0) / GB

    def tier_put(lat: list) -> float:
        ts = []
        for _ in range(passes):
            for k in keys:
                tier.delete(k)
            for m in metas:
                t = time.perf_counter()
                assert tier.put(m, src)
                ts.append(time.perf_counter() - t)
        lat += ts
        return vol / sum(ts) / GB

    def tier_get(lat: list) -> float:
        ts = []
        for _ in range(passes):
            for k in keys:
                t = time.perf_counter()
                assert tier.get_into(k, out) is not None
                ts.append(time.perf_counter() - t)
        lat += ts
        return vol / sum(ts) / GB

    fig: dict[str, list[float]] = {"memcpy": [], "memcpy_put": [], "get": [], "put": []}
    lats: dict[str, list[float]] = {"get": [], "put": []}
    fns: dict[str, Callable[[list], float]] = {"memcpy": memcpy_get, "get": tier_get,
                                                "memcpy_put": memcpy_put, "put": tier_put}
    for r in range(repeat):
        for base, mine in (("memcpy", "get"), ("memcpy_put", "put")):
            for name in order(r, base, mine):
                fig[name].append(fns[name](lats.get(name, [])))
    tier.close()
    slab.release()
    res = {"memcpy_gbps": spread(fig["memcpy"])["median"], "memcpy_put_gbps": spread(fig["memcpy_put"])["median"],
           "get_gbps": spread(fig["get"])["median"], "put_gbps": spread(fig["put"])["median"],
           "get_vs_memcpy": ratio_stats(fig["get"], fig["memcpy"]),
           "put_vs_memcpy": ratio_stats(fig["put"], fig["memcpy_put"]),
           "spread": {f"{k}_gbps": spread(v) for k, v in fig.items()},
           "first_fill_gbps": round(first_fill, 3), "get": _lat(lats["get"]), "put": _lat(lats["put"]),
           "chunks": n, "passes_per_round": passes, "rounds": repeat}
    return res


# -- disk ---------------------------------------------------------------------------------
def raw_disk(path: Path, chunk: int, n: int, buf: memoryview | None = None) -> dict:
    """One raw pass: sequential O_DIRECT write then read (after a page-cache drop) of n
    chunk-sized blocks to one file, no checksum (fio when available)."""
    f = path / "raw.bin"
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    if shutil.which("fio"):
        res = {}
        for rw in ("write", "read"):
            cmd = ["fio", "--name=raw", f"--filename={f}", f"--rw={rw}", f"--bs={block}", f"--size={n * block}",
                   "--direct=1", "--ioengine=psync", "--output-format=json", "--end_fsync=1"]
            out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            res[f"raw_{rw}_gbps"] = out["jobs"][0][rw]["bw_bytes"] / GB
        _remove(f)
        return {**res, "raw_tool": "fio"}
    if buf is None:
        buf = _random(block, 1)
    fd, direct = open_direct(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)
    t0 = time.perf_counter()
    for i in range(n):
        os.pwrite(fd, buf, i * block)
    os.fsync(fd)
    w = n * block / (time.perf_counter() - t0) / GB
    os.close(fd)
    _drop_cache([str(f)])
    fd, _ = open_direct(str(f), os.O_RDONLY, True)
    t0 = time.perf_counter()
    for i in range(n):
        os.preadv(fd, [buf], i * block)
    r = n * block / (time.perf_counter() - t0) / GB
    os.close(fd)
    _remove(f)
    return {"raw_write_gbps": w, "raw_read_gbps": r, "raw_tool": "python" + ("" if direct else "-buffered")}


def raw_read_same_io(path: Path, chunk: int, n: int, o_direct: bool) -> float:
    """GB/s of raw reads of n fresh chunk-sized files with ``get_into``'s pieces in flight (one chunk
    at a time, as this bench calls it) and read mode; no checksum."""
    from kvtier.bench.rawread import best_raw_read, tier_reads_in_flight
    from kvtier.chunk import file_size

    fbytes = file_size(chunk)
    inflight, piece = tier_reads_in_flight(fbytes, 1, o_direct)
    r = best_raw_read(path / "raw-same-io", fbytes, n, inflight, piece, tries=1, o_direct=o_direct)
    os.sync()
    return r.bytes_per_s / GB


def raw_write_parallel(path: Path, chunk: int, n: int, buf: memoryview, threads: int = WRITER_THREADS) -> float:
    """Raw O_DIRECT writes at the writer pool's concurrency: ``threads`` threads, each writing
    its share of the n chunk-sized blocks sequentially to its own file (then fsync)."""
    import threading
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    files = [path / f"raw{i}.bin" for i in range(threads)]
    fds = [open_direct(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)[0] for f in files]

    def write(i: int) -> None:
        for j in range(i, n, threads):
            os.pwrite(fds[i], buf, (j // threads) * block)
        os.fsync(fds[i])
    ts = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w = n * block / (time.perf_counter() - t0) / GB
    for fd in fds:
        os.close(fd)
    for f in files:
        f.unlink()
    os.sync()
    return w


def bench_disk(path: Path, chunk: int, n: int, o_direct: bool, o_direct_read: bool | None = None,
               src: memoryview | None = None, asynchronous: bool = False, same_files: bool = False,
               round_index: int = 0) -> dict:
    """One tier pass: put every chunk (synchronous ``DiskTier.put``, one thread; or, with
    ``asynchronous``, ``submit`` to the writer pool, the path ``TieredStore.put`` takes, and
    ``flush``), sync, drop the files from the page cache, ``get_into`` every chunk.

    ``same_files`` (O_DIRECT reads only): the same files are also read raw (whole file per
    ``preadv``, no checksum) and by ``get_into`` with one read per chunk, each pass after a page
    cache drop, in an order that rotates with ``round_index``; plus the files' layout."""
    ns = _ns(chunk)
    _remove(path / ns.short_id())
    tier = DiskTier.open(path, ns, capacity=n * (chunk + 8192) + 2**20, o_direct=o_direct,
                         o_direct_read=o_direct_read, writer_threads=WRITER_THREADS, queue_depth=n + 1,
                         telemetry=Telemetry())
    if src is None:
        src = _random(chunk, 2)
    out = _aligned(chunk)
    keys = chunk_keys(ns, np.arange(n * TOKENS))
    put_t, get_t = [], []
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        meta = ChunkMeta(k, None, TOKENS, (chunk,), "uint8", chunk)
        assert tier.write([WriteItem(meta, src, lambda: None)])[0] if asynchronous else tier.put(meta, src)
        if not asynchronous:     # a submit's latency is not a write's
            put_t.append(time.perf_counter() - t)
    if asynchronous:
        assert tier.flush(600)
    os.sync()           # written back: buffered data (and O_DIRECT's trailer page) is part of the put
    put_wall = time.perf_counter() - t0
    _drop_cache([tier.path_of(k) for k in keys])
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        assert tier.get_into(k, out) is not None
        get_t.append(time.perf_counter() - t)
    get_wall = time.perf_counter() - t0
    extra: dict = {}
    if same_files and tier.o_direct_read:
        extra = _same_files(tier, keys, out, chunk, round_index)
    tier.close()
    _remove(path / ns.short_id())
    return {"put_gbps": n * chunk / put_wall / GB, "get_gbps": n * chunk / get_wall / GB,
            "put_s": put_t, "get_s": get_t, **extra}


def _same_files(tier: DiskTier, keys: list, out: memoryview, chunk: int, round_index: int) -> dict:
    """After the timed get: the headline's attribution passes on the same chunk files (see
    ``bench_disk``). The timed get ran first; the other passes rotate so that none of the three
    is always first after the put (a host cache favours whichever reads second)."""
    from kvtier.chunk import file_size
    paths = [tier.path_of(k) for k in keys]
    vol = len(keys) * chunk
    rbuf = _aligned(file_size(chunk))

    def tier_get() -> float:
        t0 = time.perf_counter()
        for k in keys:
            assert tier.get_into(k, out) is not None
        return time.perf_counter() - t0

    def one_read() -> float:
        old = diskio.READ_PIPELINE_MIN
        diskio.READ_PIPELINE_MIN = 1 << 62          # one preadv per chunk, checksum after it
        try:
            return tier_get()
        finally:
            diskio.READ_PIPELINE_MIN = old

    passes = {"raw_files": lambda: raw_read_files(paths, file_size(chunk), rbuf), "get_one_read": one_read,
              "get_again": tier_get}
    names = list(passes)
    names = names[round_index % 3:] + names[:round_index % 3]
    res: dict = {}
    for name in names:
        _drop_cache(paths)
        c0 = time.process_time()
        dt = passes[name]()
        res[name] = (vol / dt / GB, (time.process_time() - c0) / (vol / GB))
    rbuf.release()
    return {"raw_read_same_files_gbps": res["raw_files"][0], "get_one_read_gbps": res["get_one_read"][0],
            "get_again_gbps": res["get_again"][0], "raw_read_same_files_cpu_s_per_gb": res["raw_files"][1],
            "get_cpu_s_per_gb": res["get_again"][1], "get_one_read_cpu_s_per_gb": res["get_one_read"][1],
            "layout": file_layout(paths)}


def bench_disk_rounds(path: Path, chunk: int, n: int, repeat: int, variants: list[str], log=print) -> dict:
    """``repeat`` rounds; each runs the raw pass and the headline tier pass back to back
    (alternating order), then the other tier variants."""
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    raw_buf = _random(block, 1)
    src = _random(chunk, 2)
    raw: dict[str, list[float]] = {"raw_write_gbps": [], "raw_read_gbps": []}
    if "direct_async" in variants:
        raw[f"raw_write_qd{WRITER_THREADS}_gbps"] = []
    tiers: dict[str, dict[str, list]] = {v: {"put_gbps": [], "get_gbps": [], "put_s": [], "get_s": []}
                                         for v in variants}
    same_io: dict[bool, list[float]] = {rd: [] for rd in sorted({VARIANTS[v][1] for v in variants})}
    tool = "python"
    for r in range(repeat):
        for rd in same_io:       # raw reads at the tier's own concurrency and read mode, fresh files
            same_io[rd].append(raw_read_same_io(path, chunk, n, o_direct=rd))
        def run_pass(name: str) -> None:
            nonlocal tool
            if name == "raw":
                res = raw_disk(path, chunk, n, raw_buf)
                tool = res.pop("raw_tool")
                for k, v in res.items():
                    raw[k].append(v)
                return
            if name == "raw_parallel":
                raw[f"raw_write_qd{WRITER_THREADS}_gbps"].append(raw_write_parallel(path, chunk, n, raw_buf))
                return
            w, rd = VARIANTS[name]
            res = bench_disk(path, chunk, n, o_direct=w, o_direct_read=rd, src=src,
                             asynchronous=name == "direct_async", same_files=name == HEADLINE, round_index=r)
            for k, v in res.items():
                tiers[name].setdefault(k, [])
                tiers[name][k] += v if isinstance(v, list) else [v]
        for name in order(r, "raw", HEADLINE):
            run_pass(name)
        if "direct_async" in variants:       # the writer pool vs raw writes at the same concurrency
            for name in order(r, "raw_parallel", "direct_async"):
                run_pass(name)
        for name in variants:
            if name not in (HEADLINE, "direct_async"):
                run_pass(name)
        h = tiers[HEADLINE]
        same = (f" | same files: raw {h['raw_read_same_files_gbps'][-1]:.2f} get {h['get_again_gbps'][-1]:.2f}"
                f" one-read get {h['get_one_read_gbps'][-1]:.2f}") if h.get("raw_read_same_files_gbps") else ""
        log(f"    round {r + 1}/{repeat}: raw write {raw['raw_write_gbps'][-1]:.2f} read {raw['raw_read_gbps'][-1]:.2f}"
            f" | {HEADLINE} put {h['put_gbps'][-1]:.2f} get {h['get_gbps'][-1]:.2f} GB/s"
            + "".join(f" | {v} put {tiers[v]['put_gbps'][-1]:.2f} get {tiers[v]['get_gbps'][-1]:.2f}"
                      for v in variants if v != HEADLINE) + same)
    out: dict = {"raw_tool": tool, "chunks": n, "rounds": repeat,
                 "raw_write_gbps": spread(raw["raw_write_gbps"])["median"],
                 "raw_read_gbps": spread(raw["raw_read_gbps"])["median"],
                 "spread": {k: spread(v) for k, v in raw.items()},
                 "per_round": {k: [sig(x) for x in v] for k, v in raw.items()}, "variants": {}}
    for name, t in tiers.items():
        w, rd = VARIANTS[name]
        out["variants"][name] = {
            "o_direct_write": w, "o_direct_read": rd,
            "put_gbps": spread(t["put_gbps"])["median"], "get_gbps": spread(t["get_gbps"])["median"],
            "get_vs_raw_read": ratio_stats(t["get_gbps"], raw["raw_read_gbps"]),
            "raw_read_same_io_gbps": spread(same_io[rd]),
            "get_vs_raw_read_same_io": ratio_stats(t["get_gbps"], same_io[rd]),
            "put_vs_raw_write": ratio_stats(t["put_gbps"], raw["raw_write_gbps"]),
            "spread": {"put_gbps": spread(t["put_gbps"]), "get_gbps": spread(t["get_gbps"])},
            "per_round": {"put_gbps": [sig(x) for x in t["put_gbps"]],
                          "get_gbps": [sig(x) for x in t["get_gbps"]]},
            "put": _lat(t["put_s"]) if t["put_s"] else {"p50_ms": None, "p99_ms": None}, "get": _lat(t["get_s"])}
        if t.get("raw_read_same_files_gbps"):
            out["variants"][name].update({
                "raw_read_same_files_gbps": spread(t["raw_read_same_files_gbps"]),
                "get_again_gbps": spread(t["get_again_gbps"]),
                "get_one_read_gbps": spread(t["get_one_read_gbps"]),
                "get_vs_raw_read_same_files": ratio_stats(t["get_again_gbps"], t["raw_read_same_files_gbps"]),
                "get_one_read_vs_raw_read_same_files": ratio_stats(t["get_one_read_gbps"],
                                                                   t["raw_read_same_files_gbps"]),
                "raw_read_same_files_vs_raw_read": ratio_stats(t["raw_read_same_files_gbps"], raw["raw_read_gbps"]),
                "cpu_s_per_gb": {k: spread(t[f"{k}_cpu_s_per_gb"])
                                 for k in ("get", "get_one_read", "raw_read_same_files")},
                "layout_per_round": t["layout"]})
        if name == "direct_async":
            qd = f"raw_write_qd{WRITER_THREADS}_gbps"
            out[qd] = spread(raw[qd])["median"]
            out["variants"][name].update({"writer_threads": WRITER_THREADS,
                                          f"put_vs_raw_write_qd{WRITER_THREADS}": ratio_stats(t["put_gbps"], raw[qd])})
    out["verify"] = {k: sig(v) if isinstance(v, float) else v for k, v in verify_speed(_random(chunk, 3)).items()}
    h = out["variants"][HEADLINE]
    out.update({"get_gbps": h["get_gbps"], "put_gbps": h["put_gbps"], "get_vs_raw_read": h["get_vs_raw_read"],
                "put_vs_raw_write": h["put_vs_raw_write"], "get": h["get"], "put": h["put"], "tier": HEADLINE})
    out["spread"].update(h["spread"])
    return out


# -- lookup, recovery ---------------------------------------------------------------------
def bench_lookup(path: Path, reps: int = 200) -> dict:
    from kvtier.store import TieredStore
    ns = Namespace("bench", "lookup", "bfloat16", "bench", 16, TOKENS)
    toks = np.arange(128 * TOKENS)
    t_hash = []
    for _ in range(reps):
        t = time.perf_counter()
        keys = chunk_keys(ns, toks)
        t_hash.append(time.perf_counter() - t)
    toks_list = toks.tolist()
    t_hash_list = []
    for _ in range(max(1, reps // 4)):
        t = time.perf_counter()
        chunk_keys(ns, toks_list)
        t_hash_list.append(time.perf_counter() - t)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    res = {}
    for where in ("disk", "memory"):
        cfg = StoreConfig.model_validate({"memory": {"enabled": where == "memory", "capacity": 2**24},
                                          "disk": {"enabled": True, "path": str(path), "capacity": 2**30}})
        with TieredStore.open(cfg, ns) as store:
            for i, k in enumerate(keys):
                store.put(k, keys[i - 1] if i else None, b"x" * 64, num_tokens=TOKENS, shape=(64,), dtype="uint8")
            store.flush(60)
        if where == "disk":       # cold metadata: a reopened store, the kernel's dentry/inode caches dropped
            dropped = drop_kernel_caches()
            with TieredStore.open(cfg, ns) as store:
                t = time.perf_counter()
                r = store.lookup(keys)
                res["lookup_disk_cold_ms_128_chunks"] = round((time.perf_counter() - t) * 1e3, 4)
                res["lookup_disk_cold_caches_dropped"] = dropped
                assert r.num_chunks == 128
        with TieredStore.open(cfg, ns) as store:
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                r = store.lookup(keys)
                ts.append(time.perf_counter() - t)
            assert r.num_chunks == 128
        res[f"lookup_{where}_ms_128_chunks"] = round(statistics.median(ts) * 1e3, 4)
        res[f"lookup_{where}_p99_ms"] = round(_pct(ts, 99), 4)
        res[f"lookup_{where}_max_ms"] = round(max(ts) * 1e3, 4)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    res["lookup_ms_128_chunks"] = res["lookup_disk_ms_128_chunks"]
    res["lookup_reps"] = reps
    res["keys_ms_32k_tokens_numpy"] = round(statistics.median(t_hash) * 1e3, 4)
    res["keys_ms_32k_tokens_list"] = round(statistics.median(t_hash_list) * 1e3, 4)
    return res


def drop_kernel_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (page cache, dentries, inodes); False when not
    allowed (not root, a container without it)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def virtual_disk_note(path: Path) -> str | None:
    """A warning when ``path`` lives on a virtual block device (its host may cache it)."""
    try:
        dev = os.stat(path).st_dev
        sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        disk = sysdev.parent if (sysdev / "partition").exists() else sysdev
        driver = (disk / "device" / "driver").resolve().name if (disk / "device" / "driver").exists() else ""
        name = disk.name
    except OSError:
        return None
    if driver.startswith("virtio") or name.startswith(("vd", "xvd")):
        return (f"{name} is a virtual disk ({driver or 'virtual'}): O_DIRECT bypasses this guest's page cache, "
                "but the host may serve reads from its own cache, so disk figures can exceed the device")
    return None


def bench_recovery(path: Path, n: int) -> dict:
    """Time DiskTier.open (index rebuild) over n chunk files: first without a manifest
    (every header read), then with the manifest written by close()."""
    from kvtier.chunk import encode
    ns = Namespace("bench", f"recovery{n}", "bfloat16", "bench", 16, TOKENS)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    tier = DiskTier.open(path, ns, capacity=2**40, telemetry=Telemetry())
    keys = chunk_keys(ns, np.arange(n * TOKENS, dtype=np.uint32))
    for i, k in enumerate(keys):   # tiny chunks written directly: we time the index, not the data
        p = tier.path_of(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, encode(ns.digest(), ChunkMeta(k, keys[i - 1] if i else None, TOKENS, (8,), "uint8", 8), b"x" * 8))
        os.close(fd)
    tier.close()
    os.unlink(path / ns.short_id() / "manifest")
    t0 = time.perf_counter()
    tier = DiskTier.open(path, ns, capacity=2**40, telemetry=Telemetry())
    cold = time.perf_counter() - t0
    assert tier.usage().num_chunks == n
    tier.close()
    t0 = time.perf_counter()
    tier = DiskTier.open(path, ns, capacity=2**40, telemetry=Telemetry())
    warm = time.perf_counter() - t0
    tier.close()
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    return {"chunks": n, "open_s_no_manifest": round(cold, 3), "open_s_with_manifest": round(warm, 3)}


def machine(path: Path) -> dict:
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "?")
    df = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "mem_total_kib": int(mem), "kernel": platform.release(),
            "virtual_disk_note": virtual_disk_note(path),
            "python": platform.python_version(), "df": df, "fs_type": df.splitlines()[-1].split()[1] if df else "?",
            "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")}


# -- driver -------------------------------------------------------------------------------
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
            f"[rounds {p['min']:.2f}-{p['max']:.2f}] (target >= 0.8x) [{disk['raw_tool']}]")
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


def targets(r: dict) -> dict:
    """Each issue target per model: the median per-round ratio (and its min) against the threshold."""
    out = {}
    for name, d in r["models"].items():
        for key, fig, thr in (("memory_get", d["memory"]["get_vs_memcpy"], 0.5),
                              ("disk_get", d["disk"]["get_vs_raw_read"], 0.9),
                              ("disk_put", d["disk"]["put_vs_raw_write"], 0.8)):
            out[f"{name}.{key}"] = {"ratio_median": fig["median"], "ratio_min": fig["min"], "target": thr,
                                    "met": fig["median"] >= thr}
        # the store's own put path (TieredStore.put -> writer pool) against raw O_DIRECT writes at the
        # same concurrency, measured back to back in each round
        pool = d["disk"]["variants"].get("direct_async", {}).get(f"put_vs_raw_write_qd{WRITER_THREADS}")
        if pool:
            out[f"{name}.disk_put_store_path"] = {"ratio_median": pool["median"], "ratio_min": pool["min"],
                                                  "target": 0.8, "met": pool["median"] >= 0.8}
    out["lookup_ms_128_chunks"] = {"value": r["lookup_ms_128_chunks"], "target": 1.0,
                                   "met": r["lookup_ms_128_chunks"] <= 1.0}
    return out


def to_markdown(r: dict) -> str:
    """A human report of one run (machine, command, figures vs raw baselines and targets)."""
    m = r["machine"]
    n_rounds = r.get("repeat", 1)
    lines = [f"# kvtier store benchmark ({time.strftime('%Y-%m-%d', time.gmtime(r.get('time', time.time())))})", "",
             f"Command: `{r.get('command', 'kvtier bench store')}`", "",
             f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_kib'] / 2**20:.1f} GiB RAM, kernel {m['kernel']},"
             f" Python {m['python']}; disk under test ({m['fs_type']}):", "", "```", m["df"], "```", "",
             f"Volume per model per disk pass: {r['volume_bytes'] / 2**20:.0f} MiB; {n_rounds} rounds; in each round "
             "the raw pass and the O_DIRECT tier pass run back to back (order alternating), so both see the same "
             "disk state. Disk files are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before every read "
             "pass; puts are timed until written back (sync). Raw baselines: memcpy between pre-faulted buffers; sequential O_DIRECT write/read of the same "
             f"volume in chunk-sized blocks, one file, no checksum ({r['disk']['raw_tool']}). The store puts with "
             "`DiskTier.put` (one thread, queue depth 1, checksum + temp file + publish per chunk) and reads with "
             "`get_into` (checksum verified). Figures: median (min–max) over the rounds, GB/s; ratios: median "
             "(min–max) of the per-round ratios, and in brackets the ratio of the medians.", "",
             "| model | chunk | tier | get GB/s | baseline GB/s | get ratio (target) | put GB/s | baseline GB/s "
             "| put ratio (target) | get p50/p99 ms | put p50/p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, d in r["models"].items():
        mb = f"{d['chunk_bytes'] / 2**20:.2f} MiB"
        me, di = d["memory"], d["disk"]
        gs, ps = me["get_vs_memcpy"], me["put_vs_memcpy"]
        lines.append(f"| {name} | {mb} | memory | {fig(me['spread']['get_gbps'])} | memcpy "
                     f"{fig(me['spread']['memcpy_gbps'])} | **{fig(gs)}** [{gs['of_medians']}] (≥0.5) | "
                     f"{fig(me['spread']['put_gbps'])} | memcpy {fig(me['spread']['memcpy_put_gbps'])} | "
                     f"{fig(ps)} [{ps['of_medians']}] | {me['get']['p50_ms']}/{me['get']['p99_ms']} | "
                     f"{me['put']['p50_ms']}/{me['put']['p99_ms']} |")
        rr, rw = fig(di["spread"]["raw_read_gbps"]), fig(di["spread"]["raw_write_gbps"])
        for v, t in di["variants"].items():
            g, p = t["get_vs_raw_read"], t["put_vs_raw_write"]
            head = v == r.get("headline_variant", HEADLINE)
            label = {"direct": "disk (O_DIRECT)", "direct_write": "disk (O_DIRECT write, buffered read)",
                     "direct_async": f"disk (O_DIRECT, put via the {WRITER_THREADS}-thread writer pool)",
                     "buffered": "disk (buffered)"}.get(v, v)
            gt, pt = (" (≥0.9)", " (≥0.8)") if head else ("", "")
            b = "**" if head else ""
            lines.append(f"| {name} | {mb} | {label} | {fig(t['spread']['get_gbps'])} | raw read {rr} | "
                         f"{b}{fig(g)}{b} [{g['of_medians']}]{gt} | {fig(t['spread']['put_gbps'])} | raw write {rw} | "
                         f"{b}{fig(p)}{b} [{p['of_medians']}]{pt} | {t['get']['p50_ms']}/{t['get']['p99_ms']} | "
                         f"{t['put']['p50_ms'] or '–'}/{t['put']['p99_ms'] or '–'} |")
    for name, d in r["models"].items():
        t = d["disk"]["variants"].get("direct_async")
        if t:
            q = t[f"put_vs_raw_write_qd{WRITER_THREADS}"]
            lines += ["", f"{name}: put through the writer pool ({WRITER_THREADS} threads, `submit` + `flush`, the path "
                      f"`TieredStore.put` takes) vs raw O_DIRECT writes at the same concurrency ({WRITER_THREADS} "
                      f"threads, own file each: {fig(d['disk']['spread'][f'raw_write_qd{WRITER_THREADS}_gbps'])} GB/s):"
                      f" {fig(q)} [{q['of_medians']}]."]
    lines += ["", "Raw reads at the tier's own concurrency and read mode (fresh files, `get_into`'s pieces in "
              "flight, no checksum) against each variant's get (a ratio above 1: that baseline was no ceiling):", ""]
    for name, d in r["models"].items():
        for v, t in d["disk"]["variants"].items():
            if "get_vs_raw_read_same_io" in t:
                lines.append(f"* {name} {v}: raw {fig(t['raw_read_same_io_gbps'])} GB/s, get ratio "
                             f"{fig(t['get_vs_raw_read_same_io'])} [{t['get_vs_raw_read_same_io']['of_medians']}]")
    lines += attribution_markdown(r, HEADLINE)
    if m.get("virtual_disk_note"):
        lines += ["", f"Note: {m['virtual_disk_note']}."]
    lines += ["", "Per-round figures (GB/s; raw read/write, then O_DIRECT tier get/put):", ""]
    for name, d in r["models"].items():
        di = d["disk"]
        h = di["variants"][r.get("headline_variant", HEADLINE)]["per_round"]
        lines.append(f"* {name}: raw read {di['per_round']['raw_read_gbps']}, get {h['get_gbps']}; "
                     f"raw write {di['per_round']['raw_write_gbps']}, put {h['put_gbps']}")
    rec = r.get("index_recovery", {})
    tg = r.get("targets", {})
    lines += ["", f"Memory first fill (slab allocation + page faults, once per process): "
              f"{r['models']['default']['memory']['first_fill_gbps']} GB/s (default model).", "",
              f"Lookup of a 32K-token prompt (128 chunks): {r['lookup_disk_ms_128_chunks']} ms median over "
              f"{r.get('lookup_reps', 200)} lookups with every chunk on disk, warm metadata (p99 "
              f"{r['lookup_disk_p99_ms']} ms); cold metadata (first lookup of a reopened store, kernel caches "
              f"{'dropped' if r.get('lookup_disk_cold_caches_dropped') else 'NOT dropped (not allowed)'}): "
              f"{r.get('lookup_disk_cold_ms_128_chunks')} ms; "
              f"{r['lookup_memory_ms_128_chunks']} ms in RAM (target ≤ 1 ms). Key "
              f"hashing for those 32K tokens, separately: {r['keys_ms_32k_tokens_numpy']} ms from a numpy array, "
              f"{r['keys_ms_32k_tokens_list']} ms from a Python list.", "",
              f"Index recovery at open for {rec.get('chunks')} chunk files: {rec.get('open_s_no_manifest')} s reading "
              f"every header, {rec.get('open_s_with_manifest')} s with the manifest.", ""]
    if tg:
        lines += ["Targets (median of per-round ratios; min in brackets):", ""]
        for k, t in tg.items():
            val = f"{t['ratio_median']} (min {t['ratio_min']})" if "ratio_median" in t else f"{t['value']} ms"
            lines.append(f"* {k}: {val}, target {'≥' if 'ratio_median' in t else '≤'} {t['target']}: "
                         f"{'met' if t['met'] else 'MISSED'}")
        lines.append("")
    if "sharedfs" in r:
        from kvtier.bench.store_bench_sharedfs import markdown_rows
        lines += markdown_rows(r["sharedfs"])
    if "duration_s" in r:
        lines += [f"Bench duration: {r['duration_s']} s.", ""]
    from kvtier.bench.store_bench_shared import shared_markdown  # rows of --shared (services helper)
    lines += shared_markdown(r)
    return "\n".join(lines)
