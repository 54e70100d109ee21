"""`kvtier bench store --sharedfs DIR [--sharedfs-read DIR2]`: the shared-filesystem tier vs raw I/O.

Per round, at the SAME concurrency (``threads`` callers, each with one chunk in flight):

* **raw put**: each thread writes whole chunk-sized files (open, one write, close) — no
  header, checksum, temp file or rename: the mount's own ceiling for these bytes;
* **tier put**: each thread calls ``SharedFsTier.put`` (verified format, temp + rename, stamp);
  the leaf directories the keys land in are created before the timed pass (a populated mount
  has all of them; a fresh one pays one or two ``mkdir`` per new directory once);
* **raw get** / **tier get**: the same files read back whole (``read_into`` per chunk, verified,
  with lent buffers — ``lent=True``, as the connector's async loads read: the payload goes
  straight into the caller's buffer, no bounce copy), through ``read_dir`` — a second mount of
  the same volume ("the other machine", with its own empty client cache) when given, else the
  writing mount.

Raw and tier passes are interleaved in blocks of ``block`` chunks (raw block, tier block, in
alternating order from block to block), so a slow moment of the mount — on a shared 2-core VM
its throughput moves 2x within seconds — hits both sides alike; a round's GB/s is its bytes over
the summed block times of that side, figures are medians over rounds, ratios the median of
per-round ratios (and of per-block ratios, ``*_vs_raw_blocks``). Per-chunk latencies (p50/p99,
ms) are pooled over rounds. ``phases``: where one tier put / get spends its time (single thread,
after the rounds): create + write + close + stamp, publish; open + read + verify (into the
caller's buffer, as a lent read).
Keys: ``get_gbps put_gbps raw_get_gbps raw_put_gbps`` (+ ``get``/``put``/``raw_get``/``raw_put``
latencies, ``get_vs_raw``/``put_vs_raw`` ratio stats).
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from kvtier.chunk import ChunkMeta
from kvtier.config import SharedFsConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline
from kvtier.tiers.sharedfs import SharedFsTier

DEFAULT_CHUNK = 23_040 * 256        # the default model's 256-token chunk (5.6 MiB)


def _lat(xs: list[float]) -> dict:
    s = sorted(xs)
    pick = lambda q: round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1e3, 3)  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "n": len(s)}


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def _threads(items: range | int, threads: int, fn: Callable[[int], None]) -> float:
    """Run fn(i) for i in ``items`` (a range, or range(n)) on ``threads`` threads (strided); wall seconds."""
    errors: list[BaseException] = []
    idx = range(items) if isinstance(items, int) else items

    def worker(t: int) -> None:
        try:
            for i in idx[t::threads]:
                fn(i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def _raw_put(d: Path, payload: memoryview, n: range | int, threads: int, lat: list[float]) -> float:
    d.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> None:
        t0 = time.perf_counter()
        fd = os.open(f"{d}/{i}.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = payload
            while len(view):
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        lat.append(time.perf_counter() - t0)
    return _threads(n, threads, one)


def _raw_get(d: Path, size: int, n: range | int, threads: int, lat: list[float]) -> float:
    bufs = [memoryview(bytearray(size)) for _ in range(threads)]

    def one(i: int) -> None:
        t0 = time.perf_counter()
        fd = os.open(f"{d}/{i}.raw", os.O_RDONLY)
        try:
            got, buf = 0, bufs[i % threads]
            while got < size:
                k = os.preadv(fd, [buf[got:]], got)
                if k == 0:
                    break
                got += k
        finally:
            os.close(fd)
        if got != size:
            raise RuntimeError(f"raw read of {d}/{i}.raw: {got} of {size} bytes")
        lat.append(time.perf_counter() - t0)
    return _threads(n, threads, one)


def _open(path: Path, ns: Namespace, threads: int) -> SharedFsTier:
    cfg = SharedFsConfig(path=path, janitor=False, max_inflight=max(threads, 1), writer_threads=max(threads, 1),
                         io_timeout_s=120, lookup_timeout_s=60, create=True)
    return SharedFsTier.open(cfg, ns, Telemetry())


def bench_sharedfs(write_dir: Path, read_dir: Path | None = None, *, chunk: int = DEFAULT_CHUNK,
                   volume: int = 256 << 20, threads: int = 4, repeat: int = 3, block: int = 8,
                   log: Callable[[str], None] = print) -> dict:
    """Measure; everything written is removed at the end. ``read_dir`` must show ``write_dir``'s
    files (the same directory through another mount)."""
    read_dir = read_dir or write_dir
    block = -(-max(block, threads) // threads) * threads     # whole strides: thread t owns buffer t
    n = max(threads, volume // chunk) // block * block or block
    run_id = uuid.uuid4().hex[:8]
    ns = Namespace(f"bench-{run_id}", "f", "float32", "L", 16, 256)
    payload = memoryview(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    fig: dict[str, list[float]] = {k: [] for k in ("get", "put", "raw_get", "raw_put")}
    lat: dict[str, list[float]] = {k: [] for k in fig}
    block_ratio: dict[str, list[float]] = {"put": [], "get": []}
    gbb = block * chunk / 1e9
    phases: dict = {}
    for r in range(repeat):
        raw_w, raw_r = write_dir / f"raw-{run_id}-{r}", read_dir / f"raw-{run_id}-{r}"
        tw, tr = _open(write_dir / f"tier-{run_id}-{r}", ns, threads), None
        keys = chunk_keys(ns, list(range(r * 10**6, r * 10**6 + 256 * n)))
        metas = [ChunkMeta(k, keys[i - 1] if i else None, 256, (chunk,), "uint8", chunk) for i, k in enumerate(keys)]
        for m in metas:       # a populated mount has every leaf directory already (65,536 at 2 levels)
            os.makedirs(os.path.dirname(tw.layout.path_of(m.key)), exist_ok=True)
        raw_w.mkdir(parents=True, exist_ok=True)
        try:
            def put(i: int) -> None:
                t0 = time.perf_counter()
                if not tw.put(metas[i], payload):
                    raise RuntimeError("sharedfs put failed")
                lat["put"].append(time.perf_counter() - t0)

            side = {"put": 0.0, "raw_put": 0.0, "get": 0.0, "raw_get": 0.0}
            for b0 in range(0, n, block):
                idx = range(b0, b0 + block)
                raw_s = lambda: _raw_put(raw_w, payload, idx, threads, lat["raw_put"])   # noqa: E731
                tier_s = lambda: _threads(idx, threads, put)                             # noqa: E731
                if (r + b0 // block) % 2 == 0:
                    t_raw, t_tier = raw_s(), tier_s()
                else:
                    t_tier, t_raw = tier_s(), raw_s()
                side["raw_put"] += t_raw
                side["put"] += t_tier
                block_ratio["put"].append(t_raw / t_tier)
            _wait_visible(raw_r / f"{n - 1}.raw")
            _wait_visible(read_dir / f"tier-{run_id}-{r}" / ns.short_id())
            tr = _open(read_dir / f"tier-{run_id}-{r}", ns, threads)
            outs = [memoryview(bytearray(chunk)) for _ in range(threads)]

            def get(i: int) -> None:
                t0 = time.perf_counter()
                res = tr.read_into([metas[i].key], [outs[i % threads]], Deadline.after(120), lent=True)[0]
                if not res.ok:
                    raise RuntimeError(f"sharedfs get missed: {res}")
                lat["get"].append(time.perf_counter() - t0)

            for b0 in range(0, n, block):
                idx = range(b0, b0 + block)
                raw_s = lambda: _raw_get(raw_r, chunk, idx, threads, lat["raw_get"])      # noqa: E731
                tier_s = lambda: _threads(idx, threads, get)                              # noqa: E731
                if (r + b0 // block) % 2 == 0:
                    t_raw, t_tier = raw_s(), tier_s()
                else:
                    t_tier, t_raw = tier_s(), raw_s()
                side["raw_get"] += t_raw
                side["get"] += t_tier
                block_ratio["get"].append(t_raw / t_tier)
            for k, t in side.items():
                fig[k].append(n * chunk / 1e9 / t)
            log(f"  sharedfs round {r + 1}/{repeat}: put {fig['put'][-1]:.2f} vs raw {fig['raw_put'][-1]:.2f} GB/s, "
                f"get {fig['get'][-1]:.2f} vs raw {fig['raw_get'][-1]:.2f} GB/s ({threads} threads, "
                f"blocks of {block} = {gbb * 1e3:.0f} MB interleaved)")
            if r == repeat - 1:
                phases = _phases(tw, tr, metas[:block], payload, raw_w)
        finally:
            tw.close()
            if tr is not None:
                tr.close()
            shutil.rmtree(raw_w, ignore_errors=True)
            shutil.rmtree(write_dir / f"tier-{run_id}-{r}", ignore_errors=True)
    out: dict = {"write_dir": str(write_dir), "read_dir": str(read_dir), "chunk_bytes": chunk, "chunks": n,
                 "threads": threads, "rounds": repeat, "block": block, "phases": phases}
    for k, v in fig.items():
        out[f"{k}_gbps"] = round(statistics.median(v), 3)
        out[f"{k}_gbps_rounds"] = [round(x, 3) for x in v]
        out[k] = _lat(lat[k])
    out["get_vs_raw"] = _spread([a / b for a, b in zip(fig["get"], fig["raw_get"])])
    out["put_vs_raw"] = _spread([a / b for a, b in zip(fig["put"], fig["raw_put"])])
    out["get_vs_raw_blocks"] = _spread(block_ratio["get"])
    out["put_vs_raw_blocks"] = _spread(block_ratio["put"])
    return out


def _phases(tw: SharedFsTier, tr: SharedFsTier | None, metas: list[ChunkMeta], payload: memoryview,
            raw_dir: Path) -> dict:
    """Single-thread breakdown (medians, ms) of one tier put and get on this mount, next to a raw
    write and read of the same bytes (new keys: nothing cached)."""
    from kvtier.chunk import encode_header
    from kvtier.tiers.sharedfs import io as sio

    t: dict[str, list[float]] = {k: [] for k in ("raw_write", "write_chunk", "publish", "raw_read", "read_verify")}
    bufs = memoryview(bytearray(len(payload)))
    for j, m in enumerate(metas):
        key = bytes(reversed(m.key))             # a fresh key per sample
        meta = ChunkMeta(key, None, m.num_tokens, m.shape, m.dtype, m.payload_len)
        final = tw.layout.path_of(key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{tw.layout.tmp}/phase-{j}.tmp"
        t0 = time.perf_counter()
        sio.write_chunk(tmp, encode_header(tw._ns, meta), payload, fsync=False, stamp_ns=time.time_ns())
        t1 = time.perf_counter()
        sio.publish(tmp, final)
        t2 = time.perf_counter()
        fd = os.open(f"{raw_dir}/phase-{j}.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = payload
        while len(view):
            view = view[os.write(fd, view):]
        os.close(fd)
        t3 = time.perf_counter()
        t["write_chunk"].append(t1 - t0)
        t["publish"].append(t2 - t1)
        t["raw_write"].append(t3 - t2)
        t4 = time.perf_counter()
        sio.read_chunk_into(final, bufs, tw._ns, key)      # as a lent read: straight into the buffer
        t5 = time.perf_counter()
        fd = os.open(f"{raw_dir}/phase-{j}.raw", os.O_RDONLY)
        buf, n = bufs, 0
        while n < len(payload):
            k = os.preadv(fd, [buf[n:]], n)
            if k == 0:
                break
            n += k
        os.close(fd)
        t6 = time.perf_counter()
        t["read_verify"].append(t5 - t4)
        t["raw_read"].append(t6 - t5)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in t.items()} | {
        "note": "through the writing mount (its client cache may hold the data it just wrote), one thread"}


def markdown_rows(s: dict) -> list[str]:
    """Lines for the store bench report."""
    return ["Shared-filesystem tier vs raw I/O on the same mount, same concurrency "
            f"({s['threads']} threads, {s['chunks']} chunks of {s['chunk_bytes'] / 2**20:.2f} MiB, {s['rounds']} rounds; "
            f"written in {s['write_dir']}, read through {s['read_dir']}):", "",
            "| | GB/s (median) | per chunk p50 / p99 ms |", "|---|---|---|",
            f"| sharedfs put | {s['put_gbps']} | {s['put']['p50_ms']} / {s['put']['p99_ms']} |",
            f"| raw write | {s['raw_put_gbps']} | {s['raw_put']['p50_ms']} / {s['raw_put']['p99_ms']} |",
            f"| sharedfs get (lent buffers) | {s['get_gbps']} | {s['get']['p50_ms']} / {s['get']['p99_ms']} |",
            f"| raw read | {s['raw_get_gbps']} | {s['raw_get']['p50_ms']} / {s['raw_get']['p99_ms']} |", "",
            f"put / raw: {s['put_vs_raw']['median']} ({s['put_vs_raw']['min']}–{s['put_vs_raw']['max']}); "
            f"get / raw: {s['get_vs_raw']['median']} ({s['get_vs_raw']['min']}–{s['get_vs_raw']['max']}) "
            "(target ≥ 0.8)" + (f"; per interleaved block of {s['block']} chunks: put {s['put_vs_raw_blocks']['median']}, "
                                f"get {s['get_vs_raw_blocks']['median']}" if "put_vs_raw_blocks" in s else "") + ".",
            *([f"Phases of one put / get, single thread, ms: {s['phases']}"] if s.get("phases") else []), ""]


def _wait_visible(path: Path, timeout: float = 30.0) -> None:
    """The other mount may show a new entry only after its entry cache expires (JuiceFS: 1 s)."""
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise RuntimeError(f"{path} not visible after {timeout:.0f}s")
        time.sleep(0.05)


__all__ = ["bench_sharedfs", "DEFAULT_CHUNK", "markdown_rows"]
