"""Chunk chains for backend tests: keys chained like real prompts, random payloads, buffers."""

from __future__ import annotations

import hashlib

import numpy as np

from kvtier.chunk import ChunkMeta
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.protocol import WriteItem

NS = Namespace("m", "f", "float32", "test-layout", 16, 16)


def chain(n: int, payload_len: int = 64 * 1024, seed: int = 0) -> list[tuple[ChunkMeta, bytes]]:
    """``n`` chained chunks (each names its predecessor as parent) with seeded random payloads."""
    rng = np.random.default_rng(seed)
    out: list[tuple[ChunkMeta, bytes]] = []
    parent: ChunkKey | None = None
    for i in range(n):
        key = ChunkKey(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest())
        meta = ChunkMeta(key, parent, 16, (payload_len // 4,), "float32", payload_len)
        out.append((meta, rng.integers(0, 256, payload_len, dtype=np.uint8).tobytes()))
        parent = key
    return out


def items(chunks: list[tuple[ChunkMeta, bytes]]) -> list[WriteItem]:
    return [WriteItem(m, memoryview(p)) for m, p in chunks]


def buffers(chunks: list[tuple[ChunkMeta, bytes]]) -> list[memoryview]:
    return [memoryview(bytearray(m.payload_len)) for m, _ in chunks]
