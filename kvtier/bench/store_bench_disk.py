"""The disk passes of ``kvtier bench store``: every ``DiskTier`` variant against the ceiling of
plain I/O of the same bytes on the same files, measured interleaved in the same round.

One round of one variant (``bench_disk``):

* put phase: the chunks in blocks of about ``BLOCK_BYTES``. For each block, the tier's put (the
  variant's own path: ``put`` on one thread, or ``write`` to the writer pool + ``flush``) and
  every plain write shape of ``store_bench_raw.WRITE_SHAPES`` (the same file bytes under the same
  names in the tier's layout, the same O_DIRECT choice, the same number of threads, one reused
  source buffer) run back to back in an order that rotates with the block, each timed until
  written back (``os.sync`` inside its timing, as a buffered put must be);
* get phase: per chunk file, in an order rotating with the chunk, ``get_into`` (checksum verified)
  and every plain read shape of ``READ_SHAPES`` of that same file, each right after the file was
  evicted from the page cache, the same O_DIRECT choice, one reused buffer each; the headline
  variant also reads it with ``get_into`` issuing one read per chunk (checksum after it).

Each pass's figure is the payload bytes over its time summed over the blocks (chunks), so the
tier and its plain-I/O variants see the same disk state at the same moments (this VM's disk
varies 2x within a minute). The round's ceiling is the best of the plain variants
(``store_bench_rounds.against_ceiling``). What the plain I/O leaves out: the checksum, the ledger
lock and update, the index; ``create`` and ``padded`` also the rename (``publish`` keeps it).

References, once per round (not ceilings: other files): one preallocated file written and read
sequentially (``raw_disk``) and fresh files read at the tier's reads in flight."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.bench.disk_attribution import file_layout, verify_speed
from kvtier.bench.store_bench_files import aligned_buffer, bench_namespace, random_buffer, remove_settled
from kvtier.bench.store_bench_raw import (READ_SHAPES, WRITE_SHAPES, prepare_layout, raw_disk, raw_read_same_io,
                                          read_file, write_files)
from kvtier.bench.store_bench_rounds import (GB, HEADLINE, TOKENS, VARIANTS, WRITER_THREADS, against_ceiling,
                                             latency_ms, ratio_stats, sig, spread)
from kvtier.chunk import ChunkMeta, file_size
from kvtier.keys import chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.diskio import ALIGN, read_plan
from kvtier.tiers.disklayout import NamespaceDir
from kvtier.tiers.protocol import WriteItem

BLOCK_BYTES = 64 << 20


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Clock:
    """Wall and CPU seconds (all threads) per pass name, summed over the blocks of a phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def run(self, name: str, fn) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0


def bench_disk(path: Path, chunk: int, n: int, o_direct: bool, o_direct_read: bool | None = None,
               src: memoryview | None = None, asynchronous: bool = False, same_files: bool = False,
               round_index: int = 0) -> dict:
    """One round of one tier variant against its plain-I/O ceiling variants (see the module doc).
    ``same_files`` (the headline): also ``get_into`` with one read per chunk, and the files' layout."""
    ns = bench_namespace(chunk)
    raw_dir = path / f"raw-{ns.short_id()}"
    remove_settled(path / ns.short_id())
    remove_settled(raw_dir)
    tier = DiskTier.open(path, ns, capacity=n * (chunk + 8192) + 2**20, o_direct=o_direct,
                         o_direct_read=o_direct_read, writer_threads=WRITER_THREADS, queue_depth=n + 1,
                         telemetry=Telemetry())
    fbytes = file_size(chunk)
    src = random_buffer(chunk, 2) if src is None else src
    fsrc = random_buffer(-(-fbytes // ALIGN) * ALIGN, 3)
    keys = chunk_keys(ns, np.arange(n * TOKENS))
    threads = WRITER_THREADS if asynchronous else 1
    per_block = max(1, BLOCK_BYTES // chunk)
    put_t: list[float] = []
    get_t: list[float] = []
    wr = _Clock()

    def tier_put(block: list) -> None:
        for k in block:
            t = time.perf_counter()
            meta = ChunkMeta(k, None, TOKENS, (chunk,), "uint8", chunk)
            assert tier.write([WriteItem(meta, src, lambda: None)])[0] if asynchronous else tier.put(meta, src)
            if not asynchronous:      # a submit's latency is not a write's
                put_t.append(time.perf_counter() - t)
        if asynchronous:
            assert tier.flush(600)
        os.sync()                     # written back: buffered data (and O_DIRECT's trailer page) is part of the put

    shapes = list(WRITE_SHAPES[tier.o_direct])
    layouts = {s: NamespaceDir(raw_dir / s) for s in shapes}    # one per round, as the tier's
    for s, lay in layouts.items():
        prepare_layout(lay, fanout=s == "publish")
    for b, i in enumerate(range(0, n, per_block)):
        block = keys[i:i + per_block]
        names = [k.hex() for k in block]
        for name in _rotated(["tier", *shapes], b + round_index):
            if name == "tier":
                wr.run(name, lambda: tier_put(block))
            else:
                wr.run(name, lambda s=name: write_files(layouts[s], names, fsrc, fbytes, o_direct=tier.o_direct,
                                                        shape=s, threads=threads))
    remove_settled(raw_dir)

    out = aligned_buffer(chunk)
    rbuf = aligned_buffer(-(-fbytes // ALIGN) * ALIGN)
    paths = [tier.path_of(k) for k in keys]
    rd = tier.o_direct_read
    rdc = _Clock()
    passes = ["get", *READ_SHAPES] + (["get_one_read"] if same_files else [])
    with ThreadPoolExecutor(max(1, len(read_plan(chunk, rd)) - 1), thread_name_prefix="kvtier-bench-read") as pool:
        def tier_get(k) -> None:
            t = time.perf_counter()
            assert tier.get_into(k, out) is not None
            get_t.append(time.perf_counter() - t)

        def one_read(k) -> None:
            old = tier.read_pipeline_min
            tier.read_pipeline_min = 1 << 62          # one preadv per chunk, checksum after it
            try:
                assert tier.get_into(k, out) is not None
            finally:
                tier.read_pipeline_min = old

        def plain(p: str, shape: str) -> None:
            if read_file(p, rbuf, fbytes, o_direct=rd, shape=shape, pool=pool) != fbytes:
                raise OSError(f"plain read of {p} came up short")

        for j, (k, p) in enumerate(zip(keys, paths)):
            for name in _rotated(passes, j + round_index):
                _evict(p)
                fn = {"get": lambda: tier_get(k), "get_one_read": lambda: one_read(k)}.get(
                    name, lambda s=name: plain(p, s))
                rdc.run(name, fn)
    layout = file_layout(paths) if same_files else None
    rbuf.release()
    tier.close()
    remove_settled(path / ns.short_id())
    vol = n * chunk
    res = {"put_gbps": vol / wr.wall["tier"] / GB, "get_gbps": vol / rdc.wall["get"] / GB,
           "put_s": put_t, "get_s": get_t,
           "raw_write": {s: vol / wr.wall[s] / GB for s in shapes},
           "raw_read": {s: vol / rdc.wall[s] / GB for s in READ_SHAPES},
           "cpu_s_per_gb": {("put" if k == "tier" else f"write_{k}"): c / (vol / GB) for k, c in wr.cpu.items()}
           | {(k if k.startswith("get") else f"read_{k}"): c / (vol / GB) for k, c in rdc.cpu.items()}}
    if same_files:
        res.update({"get_one_read_gbps": vol / rdc.wall["get_one_read"] / GB, "layout": layout})
    return res


def _summary(name: str, runs: list[dict], ref: dict[str, list[float]], fresh: list[float]) -> dict:
    """One variant's rounds: its figures, each against the ceiling of its rounds, and the references."""
    w, rd = VARIANTS[name]
    put, get = [x["put_gbps"] for x in runs], [x["get_gbps"] for x in runs]
    rw = against_ceiling(put, {s: [x["raw_write"][s] for x in runs] for s in runs[0]["raw_write"]})
    rr = against_ceiling(get, {s: [x["raw_read"][s] for x in runs] for s in runs[0]["raw_read"]})
    put_s = [s for x in runs for s in x["put_s"]]
    out = {"o_direct_write": w, "o_direct_read": rd,
           "writer_threads": WRITER_THREADS if name == "direct_async" else 1,
           "put_gbps": spread(put)["median"], "get_gbps": spread(get)["median"],
           "raw_write": rw, "raw_read": rr, "raw_write_gbps": rw["gbps"]["median"], "raw_read_gbps": rr["gbps"]["median"],
           "put_vs_raw_write": rw["ratio"], "get_vs_raw_read": rr["ratio"],
           "put_vs_device_write": ratio_stats(put, ref["device_write_gbps"]),
           "get_vs_device_read": ratio_stats(get, ref["device_read_gbps"]),
           "raw_read_fresh_files_gbps": spread(fresh), "get_vs_raw_read_fresh_files": ratio_stats(get, fresh),
           "spread": {"put_gbps": spread(put), "get_gbps": spread(get)},
           "per_round": {"put_gbps": [sig(x) for x in put], "get_gbps": [sig(x) for x in get]},
           "cpu_s_per_gb": {k: spread([x["cpu_s_per_gb"][k] for x in runs]) for k in runs[0]["cpu_s_per_gb"]},
           "put": latency_ms(put_s) if put_s else {"p50_ms": None, "p99_ms": None},
           "get": latency_ms([s for x in runs for s in x["get_s"]])}
    if "get_one_read_gbps" in runs[0]:
        one = [x["get_one_read_gbps"] for x in runs]
        out.update({"get_one_read_gbps": spread(one), "get_one_read_vs_raw_read": ratio_stats(one, rr["per_round"]),
                    "layout_per_round": [x["layout"] for x in runs]})
    return out


def bench_disk_rounds(path: Path, chunk: int, n: int, repeat: int, variants: list[str], log=print) -> dict:
    """``repeat`` rounds; each measures the references, then every variant against its ceiling
    (variant order rotating between rounds)."""
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    ref_buf = random_buffer(block, 1)
    src = random_buffer(chunk, 2)
    ref: dict[str, list[float]] = {"device_write_gbps": [], "device_read_gbps": []}
    fresh: dict[bool, list[float]] = {rd: [] for rd in sorted({VARIANTS[v][1] for v in variants})}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    tool = "python"
    for r in range(repeat):
        for rd in fresh:       # reference: fresh files at the tier's reads in flight and read mode
            fresh[rd].append(raw_read_same_io(path, chunk, n, o_direct=rd))
        res = raw_disk(path, chunk, n, ref_buf)
        tool = res.pop("raw_tool")
        ref["device_write_gbps"].append(res["raw_write_gbps"])
        ref["device_read_gbps"].append(res["raw_read_gbps"])
        for name in _rotated(list(variants), r):
            w, rd = VARIANTS[name]
            runs[name].append(bench_disk(path, chunk, n, o_direct=w, o_direct_read=rd, src=src,
                                         asynchronous=name == "direct_async", same_files=name == HEADLINE,
                                         round_index=r))
        log(f"    round {r + 1}/{repeat}: one-file write {ref['device_write_gbps'][-1]:.2f} read "
            f"{ref['device_read_gbps'][-1]:.2f} | " + " | ".join(
                f"{v} put {x[-1]['put_gbps']:.2f} / raw {max(x[-1]['raw_write'].values()):.2f}, get "
                f"{x[-1]['get_gbps']:.2f} / raw {max(x[-1]['raw_read'].values()):.2f}" for v, x in runs.items()))
    out: dict = {"raw_tool": tool, "chunks": n, "rounds": repeat, "block_bytes": BLOCK_BYTES,
                 "write_shapes": {"o_direct": list(WRITE_SHAPES[True]), "buffered": list(WRITE_SHAPES[False])},
                 "read_shapes": list(READ_SHAPES),
                 "device": {"write_gbps": spread(ref["device_write_gbps"]), "read_gbps": spread(ref["device_read_gbps"])},
                 "variants": {v: _summary(v, runs[v], ref, fresh[VARIANTS[v][1]]) for v in variants}}
    h = out["variants"][HEADLINE]
    out.update({"raw_read_gbps": h["raw_read_gbps"], "raw_write_gbps": h["raw_write_gbps"],
                "spread": {"raw_read_gbps": h["raw_read"]["gbps"], "raw_write_gbps": h["raw_write"]["gbps"],
                           **{k: spread(v) for k, v in ref.items()}, **h["spread"]},
                "per_round": {"raw_read_gbps": h["raw_read"]["per_round"], "raw_write_gbps": h["raw_write"]["per_round"],
                              **{k: [sig(x) for x in v] for k, v in ref.items()}},
                "get_gbps": h["get_gbps"], "put_gbps": h["put_gbps"], "get_vs_raw_read": h["get_vs_raw_read"],
                "put_vs_raw_write": h["put_vs_raw_write"], "get": h["get"], "put": h["put"], "tier": HEADLINE})
    out["verify"] = {k: sig(v) if isinstance(v, float) else v for k, v in verify_speed(random_buffer(chunk, 3)).items()}
    return out
