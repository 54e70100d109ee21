"""The disk passes of ``kvtier bench store``: ``DiskTier`` put / ``get_into`` per variant, the
headline variant's reads of the same chunk files three ways, and the rounds that pair each tier
pass with its raw baseline."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from kvtier.bench.disk_attribution import file_layout, raw_read_files, verify_speed
from kvtier.bench.store_bench_files import aligned_buffer, bench_namespace, drop_page_cache, random_buffer, remove_settled
from kvtier.bench.store_bench_raw import raw_disk, raw_read_same_io, raw_write_parallel
from kvtier.bench.store_bench_rounds import (GB, HEADLINE, TOKENS, VARIANTS, WRITER_THREADS, latency_ms, order,
                                       ratio_stats, sig, spread)
from kvtier.chunk import ChunkMeta
from kvtier.keys import chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.diskio import ALIGN
from kvtier.tiers.protocol import WriteItem


def bench_disk(path: Path, chunk: int, n: int, o_direct: bool, o_direct_read: bool | None = None,
               src: memoryview | None = None, asynchronous: bool = False, same_files: bool = False,
               round_index: int = 0) -> dict:
    """One tier pass: put every chunk (synchronous ``DiskTier.put``, one thread; or, with
    ``asynchronous``, ``submit`` to the writer pool, the path ``TieredStore.put`` takes, and
    ``flush``), sync, drop the files from the page cache, ``get_into`` every chunk.

    ``same_files`` (O_DIRECT reads only): the same files are also read raw (whole file per
    ``preadv``, no checksum) and by ``get_into`` with one read per chunk, each pass after a page
    cache drop, in an order that rotates with ``round_index``; plus the files' layout."""
    ns = bench_namespace(chunk)
    remove_settled(path / ns.short_id())
    tier = DiskTier.open(path, ns, capacity=n * (chunk + 8192) + 2**20, o_direct=o_direct,
                         o_direct_read=o_direct_read, writer_threads=WRITER_THREADS, queue_depth=n + 1,
                         telemetry=Telemetry())
    if src is None:
        src = random_buffer(chunk, 2)
    out = aligned_buffer(chunk)
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
    drop_page_cache([tier.path_of(k) for k in keys])
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
    remove_settled(path / ns.short_id())
    return {"put_gbps": n * chunk / put_wall / GB, "get_gbps": n * chunk / get_wall / GB,
            "put_s": put_t, "get_s": get_t, **extra}


def _same_files(tier: DiskTier, keys: list, out: memoryview, chunk: int, round_index: int) -> dict:
    """After the timed get: the headline's attribution passes on the same chunk files (see
    ``bench_disk``). The timed get ran first; the other passes rotate so that none of the three
    is always first after the put (a host cache favours whichever reads second)."""
    from kvtier.chunk import file_size
    paths = [tier.path_of(k) for k in keys]
    vol = len(keys) * chunk
    rbuf = aligned_buffer(file_size(chunk))

    def tier_get() -> float:
        t0 = time.perf_counter()
        for k in keys:
            assert tier.get_into(k, out) is not None
        return time.perf_counter() - t0

    def one_read() -> float:
        old = tier.read_pipeline_min
        tier.read_pipeline_min = 1 << 62          # one preadv per chunk, checksum after it
        try:
            return tier_get()
        finally:
            tier.read_pipeline_min = old

    passes = {"raw_files": lambda: raw_read_files(paths, file_size(chunk), rbuf), "get_one_read": one_read,
              "get_again": tier_get}
    names = list(passes)
    names = names[round_index % 3:] + names[:round_index % 3]
    res: dict = {}
    for name in names:
        drop_page_cache(paths)
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
    raw_buf = random_buffer(block, 1)
    src = random_buffer(chunk, 2)
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
            "put": latency_ms(t["put_s"]) if t["put_s"] else {"p50_ms": None, "p99_ms": None}, "get": latency_ms(t["get_s"])}
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
    out["verify"] = {k: sig(v) if isinstance(v, float) else v for k, v in verify_speed(random_buffer(chunk, 3)).items()}
    h = out["variants"][HEADLINE]
    out.update({"get_gbps": h["get_gbps"], "put_gbps": h["put_gbps"], "get_vs_raw_read": h["get_vs_raw_read"],
                "put_vs_raw_write": h["put_vs_raw_write"], "get": h["get"], "put": h["put"], "tier": HEADLINE})
    out["spread"].update(h["spread"])
    return out
