"""Where a sharedfs get loses time against a raw read on JuiceFS, one thread (issue 11 §5's 0.70x).

    .venv/bin/python benchmarks/sharedfs/get_gap.py

Writes 24 chunks of 5.9 MB through mount a, then through mount b (no JuiceFS cache) reads each one in
four ways, 3 rounds, with the volume's data directory evicted from the page cache before each pass.
The FUSE mount's own page cache is NOT dropped, so rounds 2-3 are warm. The four ways: a raw
open+preadv+close into a bytearray, the same with an fstat, the tier's ``sharedfs_io.read_chunk``
(read + verify into the thread's bounce buffer), and ``SharedFsTier.read_into`` (adds the pool
hand-off, the copy out and the accounting). Prints the median ms per chunk of each pass.
"""
import os, sys, time, statistics, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks/sharedfs")
from common import juicefs_volume
from kvtier.chunk import ChunkMeta
from kvtier.config import SharedFsConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.sharedfs import SharedFsTier
from kvtier.tiers import sharedfs_io as sio
from kvtier.tiers.protocol import Deadline
from kvtier.bench.shared_seed import evict
import numpy as np
ns = Namespace("probe", "f", "float32", "L", 16, 128)
P = 46080 * 128
N = 24
payload = memoryview(np.random.default_rng(0).integers(0, 256, P, dtype=np.uint8).tobytes())
with tempfile.TemporaryDirectory() as t, juicefs_volume(Path(t) / "jfs") as (fs, _m):
    a = fs.mount("a"); (a.path / "kv").mkdir()
    b = fs.mount("b", extra=["--cache-size", "0"])
    while not (b.path / "kv").is_dir(): time.sleep(0.05)
    w = SharedFsTier.open(SharedFsConfig(path=a.path / "kv", janitor=False, io_timeout_s=60, lookup_timeout_s=30), ns, Telemetry())
    keys = chunk_keys(ns, list(range(N * 128)))
    for i, k in enumerate(keys):
        assert w.put(ChunkMeta(k, keys[i-1] if i else None, 128, (P,), "uint8", P), payload)
    w.close()
    r = SharedFsTier.open(SharedFsConfig(path=b.path / "kv", janitor=False, io_timeout_s=60, lookup_timeout_s=30, max_inflight=1), ns, Telemetry())
    paths = [r.layout.path_of(k) for k in keys]
    buf = memoryview(bytearray(P + 8192)); buf[:] = b"\0" * len(buf)
    out = memoryview(bytearray(P)); out[:] = b"\0" * P
    res = {}
    def raw(p):
        fd = os.open(p, os.O_RDONLY)
        try:
            n = 0; size = P + 4096 + 20
            while n < size:
                k = os.preadv(fd, [buf[n:size]], n)
                if k == 0: break
                n += k
        finally: os.close(fd)
    def rawfstat(p):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fstat(fd); n = 0; size = P + 4096 + 20
            while n < size:
                k = os.preadv(fd, [buf[n:size]], n)
                if k == 0: break
                n += k
        finally: os.close(fd)
    def rc(p): sio.read_chunk(p, P, r._ns, keys[paths.index(p)])
    def ri(p):
        i = paths.index(p); assert r.read_into([keys[i]], [out], Deadline.after(30))[0].ok
    for rnd in range(3):
        for name, fn in (("raw", raw), ("raw+fstat", rawfstat), ("read_chunk", rc), ("read_into", ri)):
            evict([str(fs.root / "bucket")])
            ts = []
            for p in paths:
                t0 = time.perf_counter(); fn(p); ts.append(time.perf_counter() - t0)
            res.setdefault(name, []).append(statistics.median(ts) * 1e3)
    for k, v in res.items(): print(f"{k:12s} median ms per chunk over rounds: {[round(x,2) for x in v]}")
    r.close()
