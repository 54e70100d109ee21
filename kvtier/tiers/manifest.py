"""The disk tier's manifest: (key, parent) of every chunk, written at close.

Only a hint that saves reading every chunk header at the next open; the directory
stays the source of truth (entries without a file are ignored, files without an
entry get their header read). Format: 64-byte records (32 B key, 32 B parent, zeros
for a first chunk) followed by the xxh3-128 of the records. A damaged manifest reads
as empty.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import xxhash

from kvtier.keys import ChunkKey

_REC = 64
_ZERO = bytes(32)


def load(path: Path) -> dict[ChunkKey, ChunkKey | None]:
    """key -> parent, or {} if the file is absent or damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    body, digest = data[:-16], data[-16:]
    if len(data) < 16 or len(body) % _REC or xxhash.xxh3_128_digest(body) != digest:
        return {}
    out: dict[ChunkKey, ChunkKey | None] = {}
    for off in range(0, len(body), _REC):
        parent = body[off + 32:off + 64]
        out[ChunkKey(body[off:off + 32])] = None if parent == _ZERO else ChunkKey(parent)
    return out


def save(path: Path, tmp: str, records: Iterable[tuple[ChunkKey, ChunkKey | None]]) -> None:
    """Write atomically (temp file + os.replace). Raises OSError; removes the temp file."""
    body = b"".join(k + (p or _ZERO) for k, p in records)
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(body + xxhash.xxh3_128_digest(body))
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
