"""Codec figures of ``kvtier bench encoding``: every shared-tier encoding on real KV chunks.

Input: the chunk files a writer engine left in its SSD directory (``shared_seed.chunk_files``: real KV of
the served prompts, verified before use). For each chunk and each encoding of ``kvtier.encoding``, on one
thread of this process:

* ``encode`` and ``decode_into`` (into a buffer allocated once), each timed alone (``perf_counter``);
* the frame's size; for the lossless ``zstd`` a byte-exact round trip is required (a mismatch makes the
  row ``exact: false`` and the run fail); for ``int8`` the error of the decoded values against the
  originals as a relative RMS: ``sqrt(sum((x' - x)^2) / sum(x^2))`` over all of a chunk's elements, its
  mean over chunks and the worst chunk's.

Figures per (dtype, encoding): ``ratio`` = plain payload bytes / encoded payload bytes (frames, without
the chunk's 4 KiB header and trailer, which every encoding pays alike); bytes per token = encoded bytes /
tokens; ``encode_mbps`` / ``decode_mbps`` = plain payload MB (1e6 B) per second of that codec step.
``plain`` is measured the same way: its "encoding" is the payload itself (no work, no encode figure),
its decode one copy.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kvtier import encoding as enc

MB = 1e6


@dataclass
class CodecRow:
    dtype: str
    encoding: str
    chunks: int = 0
    tokens: int = 0
    plain_bytes: int = 0
    encoded_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    exact: bool | None = None                 # lossless encodings: every round trip byte-exact
    rel_rms_errors: list[float] = field(default_factory=list)   # int8: per chunk

    @property
    def ratio(self) -> float:
        return self.plain_bytes / self.encoded_bytes if self.encoded_bytes else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        errs = d.pop("rel_rms_errors")
        d.update(ratio=round(self.ratio, 4),
                 plain_bytes_per_token=round(self.plain_bytes / self.tokens, 1) if self.tokens else None,
                 bytes_per_token=round(self.encoded_bytes / self.tokens, 1) if self.tokens else None,
                 encode_mbps=round(self.plain_bytes / MB / self.encode_s, 1)
                 if self.encode_s and self.encoding != "plain" else None,
                 decode_mbps=round(self.plain_bytes / MB / self.decode_s, 1) if self.decode_s else None,
                 encode_s=round(self.encode_s, 4), decode_s=round(self.decode_s, 4))
        if errs:
            d.update(rel_rms_error_mean=float(np.mean(errs)), rel_rms_error_max=float(np.max(errs)))
        return d


def as_float32(payload: memoryview | bytes, dtype: str) -> np.ndarray:
    """A payload's elements as float32 (bfloat16: the upper half of a float32's bits)."""
    if dtype == "bfloat16":
        return (np.frombuffer(payload, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(payload, {"float32": np.float32, "float16": np.float16}[dtype]).astype(np.float32)


def rel_rms_error(original: memoryview | bytes, decoded: memoryview | bytes, dtype: str) -> float:
    x, y = as_float32(original, dtype).astype(np.float64), as_float32(decoded, dtype).astype(np.float64)
    den = float(np.sum(x * x))
    return float(np.sqrt(np.sum((y - x) ** 2) / den)) if den else 0.0


def measure_codecs(disk_dir: Path, encodings: tuple[str, ...] = enc.ENCODINGS,
                   log: Callable[[str], None] = print) -> list[CodecRow]:
    """One row per (dtype, encoding) over every chunk under the disk tier directory ``disk_dir``."""
    from kvtier.bench.shared_seed import chunk_files, read_chunk_file
    from kvtier.chunk import ChunkError

    rows: dict[tuple[str, str], CodecRow] = {}
    skipped = 0
    for ns, files in chunk_files(disk_dir):
        out: memoryview | None = None
        for f in files:
            try:
                meta, payload = read_chunk_file(ns, f)
            except (ChunkError, ValueError):    # a torn or foreign file: not a real chunk, left out
                skipped += 1
                continue
            n = meta.payload_len
            if out is None or len(out) < n:
                out = memoryview(bytearray(n))
            for name in encodings:
                row = rows.setdefault((meta.dtype, name), CodecRow(meta.dtype, name))
                t0 = time.perf_counter()
                frame = enc.encode(name, payload, meta.shape, meta.dtype)
                t1 = time.perf_counter()
                got = enc.decode_into(name, frame, out, meta.shape, meta.dtype)
                t2 = time.perf_counter()
                if got != n:
                    raise RuntimeError(f"{name}: decoded {got} B of a {n}-byte payload ({f.name})")
                row.chunks += 1
                row.tokens += meta.num_tokens
                row.plain_bytes += n
                row.encoded_bytes += len(frame)
                row.encode_s += t1 - t0
                row.decode_s += t2 - t1
                if name == "int8":
                    row.rel_rms_errors.append(rel_rms_error(payload, out[:n], meta.dtype))
                else:
                    same = bytes(out[:n]) == bytes(payload)
                    row.exact = same if row.exact is None else row.exact and same
        log(f"[codec] {ns.dtype}: {len(files)} chunk files measured")
    if skipped:
        log(f"[codec] {skipped} chunk files did not verify and were left out")
    return list(rows.values())
