"""Shared helpers of the sharedfs tier tests (unit on a local directory, integration on JuiceFS)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from kvtier.chunk import ChunkMeta
from kvtier.config import SharedFsConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import WriteItem
from kvtier.tiers.sharedfs import SharedFsTier

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 12_288 + 100


def cfg(path: Path, **kw) -> SharedFsConfig:
    base = dict(path=path, janitor=False, lookup_timeout_s=5.0, io_timeout_s=10.0, probe_interval_s=0.1)
    base.update(kw)
    return SharedFsConfig(**base)


def open_tier(path: Path, telemetry: Telemetry | None = None, **kw) -> SharedFsTier:
    return SharedFsTier.open(cfg(path, **kw), NS, telemetry or Telemetry())


def chain(n: int, seed: int = 0, size: int = P) -> list[tuple[ChunkMeta, bytes]]:
    keys = chunk_keys(NS, list(range(seed * 100_000, seed * 100_000 + 4 * n)))
    rng = np.random.default_rng(seed)
    out = []
    for i, k in enumerate(keys):
        payload = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
        out.append((ChunkMeta(k, keys[i - 1] if i else None, 4, (size,), "uint8", size), payload))
    return out


def write_all(tier: SharedFsTier, items: list[tuple[ChunkMeta, bytes]]) -> list[bool]:
    """Write through the async path and wait; returns on_done's verdict per key, in order."""
    done: dict[bytes, bool] = {}
    lock = threading.Lock()

    def on_done(key: bytes, ok: bool) -> None:
        with lock:
            done[key] = ok

    accepted = tier.write([WriteItem(m, memoryview(p)) for m, p in items], on_done)
    assert tier.flush(30)
    return [a and done.get(m.key, False) for a, (m, _) in zip(accepted, items)]


def bufs(items: list[tuple[ChunkMeta, bytes]], extra: int = 0) -> list[memoryview]:
    return [memoryview(bytearray(m.payload_len + extra)) for m, _ in items]
