"""Where a sharedfs get loses time against a raw read on JuiceFS, one thread.

    .venv/bin/python benchmarks/sharedfs/get_gap.py

Writes 24 chunks of 5.9 MB through mount a, then through mount b (no JuiceFS cache) reads each one in
five ways, 3 rounds, with the volume's data directory evicted from the page cache before each pass.
The FUSE mount's own page cache is NOT dropped, so rounds 2-3 are warm. The five ways: a raw
open+preadv+close into a bytearray, the same with an fstat, the tier's ``sharedfs.io.read_chunk``
(read + verify into the thread's bounce buffer), ``SharedFsTier.read_into`` (adds the pool
hand-off, the copy out and the accounting) and ``read_into(..., lent=True)`` (the payload read
straight into the caller's buffer: no copy; how the connector's async loads read). Prints the median ms per chunk of each pass.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

CHUNK_TOKENS = 128
PAYLOAD = 46_080 * CHUNK_TOKENS        # SmolLM2-135M float32, one 128-token chunk: 5.9 MB
CHUNKS = 24
ROUNDS = 3


def raw_read(path: str, buf: memoryview, size: int, stat: bool) -> None:
    """open (+ fstat), preadv until ``size`` bytes, close: no checksum, no copy."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if stat:
            os.fstat(fd)
        n = 0
        while n < size and (k := os.preadv(fd, [buf[n:size]], n)) > 0:
            n += k
    finally:
        os.close(fd)


def main() -> int:
    import numpy as np

    from common import juicefs_volume
    from kvtier.bench.shared_seed import evict
    from kvtier.chunk import ChunkMeta, file_size
    from kvtier.config import SharedFsConfig
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.metrics import Telemetry
    from kvtier.tiers.sharedfs import io as sio
    from kvtier.tiers.protocol import Deadline
    from kvtier.tiers.sharedfs import SharedFsTier

    ns = Namespace("probe", "f", "float32", "L", 16, CHUNK_TOKENS)
    payload = memoryview(np.random.default_rng(0).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes())
    size = file_size(PAYLOAD)
    with tempfile.TemporaryDirectory() as t, juicefs_volume(Path(t) / "jfs") as (fs, _meta):
        a = fs.mount("a")
        (a.path / "kv").mkdir()
        b = fs.mount("b", extra=["--cache-size", "0"])
        while not (b.path / "kv").is_dir():
            time.sleep(0.05)
        cfg = {"janitor": False, "io_timeout_s": 60, "lookup_timeout_s": 30}
        w = SharedFsTier.open(SharedFsConfig(path=a.path / "kv", **cfg), ns, Telemetry())
        keys = chunk_keys(ns, list(range(CHUNKS * CHUNK_TOKENS)))
        for i, k in enumerate(keys):
            assert w.put(ChunkMeta(k, keys[i - 1] if i else None, CHUNK_TOKENS, (PAYLOAD,), "uint8", PAYLOAD), payload)
        w.close()
        r = SharedFsTier.open(SharedFsConfig(path=b.path / "kv", max_inflight=1, **cfg), ns, Telemetry())
        paths = [r.layout.path_of(k) for k in keys]
        buf = memoryview(bytearray(size))
        buf[:] = bytes(size)                 # touched: no first-touch faults in the timed reads
        out = memoryview(bytearray(PAYLOAD))
        out[:] = bytes(PAYLOAD)
        ways = {
            "raw": lambda i: raw_read(paths[i], buf, size, stat=False),
            "raw+fstat": lambda i: raw_read(paths[i], buf, size, stat=True),
            "read_chunk": lambda i: sio.read_chunk(paths[i], PAYLOAD, r._ns, keys[i]),
            "read_into": lambda i: r.read_into([keys[i]], [out], Deadline.after(30))[0],
            "read_into lent": lambda i: r.read_into([keys[i]], [out], Deadline.after(30), lent=True)[0],
        }
        res: dict[str, list[float]] = {}
        for _ in range(ROUNDS):
            for name, fn in ways.items():
                evict([str(fs.root / "bucket")])
                ts = []
                for i in range(CHUNKS):
                    t0 = time.perf_counter()
                    got = fn(i)
                    ts.append(time.perf_counter() - t0)
                    assert not name.startswith("read_into") or got.ok, got
                res.setdefault(name, []).append(statistics.median(ts) * 1e3)
        r.close()
    for name, v in res.items():
        print(f"{name:12s} median ms per chunk, by round: {[round(x, 2) for x in v]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
