"""Where a disk tier's verified read loses time against a raw read: the pieces `kvtier bench store`
adds to its headline variant (a baseline must be a real ceiling, and a gap to it must be
explained, not only printed).

* ``verify_speed``: the checksum a verified read computes, on one core (the ceiling of a verified
  read when nothing overlaps the hash with the device);
* ``file_layout``: how the chunk files lie on the device (FIEMAP extents, file-to-file seeks, span);
* ``raw_read_files``: raw O_DIRECT reads of the SAME chunk files (open, one ``preadv``, close);
* ``attribution_markdown``: the report's lines for the above.

Side effects: reads the files it is given; nothing else.
"""

from __future__ import annotations

import os
import time

from kvtier.tiers.diskio import ALIGN, open_direct

GB = 1e9


def verify_speed(buf: memoryview, reps: int = 5) -> dict:
    """The checksum a verified read must compute, on one core over one chunk-sized buffer (best
    of ``reps``): xxh3-128 (every chunk) and the keyed BLAKE3 MAC (signed chunks; when installed)."""
    import xxhash

    chunk = len(buf)

    def best(fn) -> float:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return chunk / min(ts) / GB

    out: dict = {"xxh3_128_gbps": best(lambda: xxhash.xxh3_128(buf).digest())}
    try:
        import blake3
    except ImportError:
        out["blake3_mac_gbps"] = None
    else:
        key = bytes(32)
        out["blake3_mac_gbps"] = best(lambda: blake3.blake3(buf, key=key, max_threads=1).digest(length=16))
    out["chunk_bytes"] = chunk
    return out


_FS_IOC_FIEMAP = 0xC020660B


def _extents(path: str) -> list[tuple[int, int, int]] | None:
    """(logical, physical, length) of a file's extents (FIEMAP), None where unsupported."""
    import fcntl
    import struct
    count = 64
    res = bytearray(struct.pack("=QQLLLL", 0, 2**64 - 1, 1, 0, count, 0) + bytes(56 * count))  # FIEMAP_FLAG_SYNC
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _FS_IOC_FIEMAP, res, True)
        finally:
            os.close(fd)
    except OSError:
        return None
    mapped = struct.unpack_from("=L", res, 20)[0]
    return [struct.unpack_from("=QQQ", res, 32 + 56 * i) for i in range(min(mapped, count))]


def file_layout(paths: list[str]) -> dict | None:
    """How the files lie on the device, in the order given (the order a pass reads them):
    extents in all, ``breaks`` (a file that does not start where the previous one ended: a seek
    for a sequential reader) and the span they cover. None where FIEMAP is not supported."""
    ends, breaks, extents, lo, hi = None, 0, 0, None, 0
    for p in paths:
        ex = _extents(p)
        if not ex:
            return None
        extents += len(ex)
        first = ex[0][1]
        if ends is not None and abs(first - ends) > ALIGN:    # the last block is partial
            breaks += 1
        ends = ex[-1][1] + ex[-1][2]
        lo = first if lo is None else min(lo, first)
        hi = max(hi, ends)
    return {"files": len(paths), "extents": extents, "breaks": breaks,
            "span_mib": round((hi - (lo or 0)) / 2**20, 1)}


def raw_read_files(paths: list[str], size: int, buf: memoryview) -> float:
    """Raw O_DIRECT read of whole files (open, one preadv each, close; no checksum): seconds."""
    n = -(-size // ALIGN) * ALIGN
    t0 = time.perf_counter()
    for p in paths:
        fd, _ = open_direct(p, os.O_RDONLY, True)
        try:
            got = os.preadv(fd, [buf[:n]], 0)
        finally:
            os.close(fd)
        if got != size:
            raise OSError(f"raw read of {p}: {got} of {size} bytes")
    return time.perf_counter() - t0




def fig(s: dict) -> str:
    """A figure's median and its spread over the rounds."""
    return f"{s['median']} ({s['min']}–{s['max']})"


def attribution_markdown(r: dict, headline: str) -> list[str]:
    """The report's lines on the same-files passes and the checksum ceiling (none if not run)."""
    lines: list[str] = []
    for name, d in r["models"].items():
        t = d["disk"]["variants"].get(r.get("headline_variant", headline), {})
        if "get_vs_raw_read_same_files" in t:
            cpu = t["cpu_s_per_gb"]
            lay = [x for x in t["layout_per_round"] if x]
            lines += ["", f"{name}, the same chunk files read three ways after the timed get (order rotating, page "
                      f"cache dropped before each): raw O_DIRECT (open, one `preadv` per file, close, no checksum) "
                      f"{fig(t['raw_read_same_files_gbps'])} GB/s = {fig(t['raw_read_same_files_vs_raw_read'])}x "
                      f"the one-file raw read; `get_into` {fig(t['get_again_gbps'])} GB/s = "
                      f"**{fig(t['get_vs_raw_read_same_files'])}x** of it; `get_into` with one read per chunk "
                      f"(checksum after) {fig(t['get_one_read_gbps'])} GB/s = "
                      f"{fig(t['get_one_read_vs_raw_read_same_files'])}x. CPU seconds per GB (all threads): "
                      f"get {cpu['get']['median']}, one-read get {cpu['get_one_read']['median']}, raw "
                      f"{cpu['raw_read_same_files']['median']}."
                      + (f" Layout (FIEMAP, in read order) per round: "
                         + "; ".join(f"{x['extents']} extents, {x['breaks']} of {x['files'] - 1} file-to-file "
                                     f"seeks, span {x['span_mib']} MiB" for x in lay) + "." if lay else "")]
    for name, d in r["models"].items():
        v = d["disk"].get("verify")
        if v:
            rr = d["disk"]["raw_read_gbps"]
            ceil = 1 / (1 / rr + 1 / v["xxh3_128_gbps"]) if rr > 0 else 0
            lines += ["", f"{name}: checksum on one core over a {v['chunk_bytes'] / 2**20:.2f} MiB chunk: xxh3-128 "
                      f"{v['xxh3_128_gbps']} GB/s ({v['chunk_bytes'] / v['xxh3_128_gbps'] / 1e6:.3f} ms a chunk)"
                      + (f", keyed BLAKE3 (signed chunks) {v['blake3_mac_gbps']} GB/s" if v.get("blake3_mac_gbps")
                         else "")
                      + f"; a verified read at the raw read's {rr} GB/s with nothing overlapped: {ceil:.4g} GB/s."]
    return lines
