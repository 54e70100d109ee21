"""Where a disk tier's verified read loses time against a raw read: the pieces `kvtier bench store`
adds to its headline variant (a baseline must be a real ceiling, and a gap to it must be
explained, not only printed).

* ``verify_speed``: the checksum a verified read computes, on one core (the ceiling of a verified
  read when nothing overlaps the hash with the device);
* ``file_layout``: how the chunk files lie on the device (FIEMAP extents, file-to-file seeks, span);
* ``attribution_markdown``: the report's lines for the above.

Side effects: reads the files it is given; nothing else.
"""

from __future__ import annotations

import os
import time

from kvtier.tiers.diskio import ALIGN

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


def fig(s: dict) -> str:
    """A figure's median and its spread over the rounds."""
    return f"{s['median']} ({s['min']}–{s['max']})"


def attribution_markdown(r: dict, headline: str) -> list[str]:
    """The report's lines on where the headline's verified read goes (its files read one read per
    chunk, CPU per GB, layout) and the checksum ceiling (none if not run)."""
    lines: list[str] = []
    for name, d in r["models"].items():
        t = d["disk"]["variants"].get(r.get("headline_variant", headline), {})
        if "get_one_read_gbps" in t:
            cpu = {k: v["median"] for k, v in t["cpu_s_per_gb"].items()}
            lay = [x for x in t.get("layout_per_round", []) if x]
            lines += ["", f"{name}, {headline}: `get_into` with one read per chunk (checksum after it) "
                      f"{fig(t['get_one_read_gbps'])} GB/s = {fig(t['get_one_read_vs_raw_read'])}x the ceiling "
                      f"(pieces in flight: {fig(t['get_vs_raw_read'])}x). CPU seconds per GB (all threads): "
                      + ", ".join(f"{k} {v}" for k, v in cpu.items()) + "."
                      + (" Layout (FIEMAP, in read order) per round: "
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
                      + f"; a verified read at the ceiling's {rr} GB/s with nothing overlapped: {ceil:.4g} GB/s."]
    return lines
