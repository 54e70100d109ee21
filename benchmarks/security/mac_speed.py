"""Cost of signed chunks: xxh3-128 checksum vs keyed BLAKE3 MAC, and disk-tier reads with each.

    python benchmarks/security/mac_speed.py [--mib 5.625] [--rounds 5]

Prints GB/s per digest over one chunk-sized buffer (one thread), and the store's disk get GB/s
(page cache warm: it isolates the verification cost) with and without ``store.signing_key``,
each the median of ``--rounds``, measured back to back in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from kvtier import chunk
from kvtier.chunk import HEADER_SIZE, ChunkMeta, checksum, encode_header
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import TieredStore


def _rate(fn, nbytes: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=5.625, help="payload MiB (SmolLM2 bf16, 256 tokens = 5.625)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=32)
    a = ap.parse_args()
    n = int(a.mib * 2**20)
    ns = Namespace("bench", "f", "bfloat16", "L", 16, 16)
    payload = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
    meta = ChunkMeta(chunk_keys(ns, list(range(16)))[0], None, 16, (n,), "uint8", n)
    plain = encode_header(ns.digest(), meta, signed=False)
    signed = encode_header(ns.digest(), meta, signed=True)
    secret = b"benchmark-secret-0123456789abcdef"
    x = _rate(lambda: checksum(plain, payload), n, a.rounds * 4)
    m = _rate(lambda: checksum(signed, payload, secret), n, a.rounds * 4)
    print(f"digest over {n / 2**20:.2f} MiB: xxh3-128 {x:.2f} GB/s, keyed BLAKE3 {m:.2f} GB/s ({m / x:.2f}x)")
    for label, extra in (("checksum", {}), ("signed", {"signing_key": secret.decode()})):
        with tempfile.TemporaryDirectory() as d:
            cfg = StoreConfig.model_validate({"chunk_size": 16, "memory": {"enabled": False},
                                              "disk": {"enabled": True, "path": d, "capacity": 2 * a.chunks * (n + HEADER_SIZE * 2)},
                                              **extra})
            keys = chunk_keys(ns, list(range(16 * a.chunks)))
            with TieredStore.open(cfg, ns) as s:
                for i, k in enumerate(keys):
                    s.put(k, keys[i - 1] if i else None, payload, num_tokens=16, shape=(n,), dtype="uint8")
                s.flush(60)
                out = bytearray(n)
                rate = _rate(lambda: [s.get_into(k, out, promote=False) for k in keys], n * len(keys), a.rounds)
            chunk._mac_keys.clear()
            print(f"disk get ({label}, page cache warm, {a.chunks} chunks): {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
