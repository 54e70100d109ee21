"""The metadata passes of ``kvtier bench store``: ``TieredStore.lookup`` of a 128-chunk prompt with
warm and cold metadata (the kernel's caches dropped when allowed), key hashing, and the disk
tier's index rebuild with and without its manifest."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from kvtier.bench.store_bench_rounds import TOKENS, percentile_ms
from kvtier.chunk import ChunkMeta
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.disk import DiskTier


def bench_lookup(path: Path, reps: int = 200) -> dict:
    from kvtier.store import TieredStore
    ns = Namespace("bench", "lookup", "bfloat16", "bench", 16, TOKENS)
    toks = np.arange(128 * TOKENS)
    t_hash = []
    for _ in range(reps):
        t = time.perf_counter()
        keys = chunk_keys(ns, toks)
        t_hash.append(time.perf_counter() - t)
    toks_list = toks.tolist()
    t_hash_list = []
    for _ in range(max(1, reps // 4)):
        t = time.perf_counter()
        chunk_keys(ns, toks_list)
        t_hash_list.append(time.perf_counter() - t)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    res = {}
    for where in ("disk", "memory"):
        cfg = StoreConfig.model_validate({"memory": {"enabled": where == "memory", "capacity": 2**24},
                                          "disk": {"enabled": True, "path": str(path), "capacity": 2**30}})
        with TieredStore.open(cfg, ns) as store:
            for i, k in enumerate(keys):
                store.put(k, keys[i - 1] if i else None, b"x" * 64, num_tokens=TOKENS, shape=(64,), dtype="uint8")
            store.flush(60)
        if where == "disk":       # cold metadata: a reopened store, the kernel's dentry/inode caches dropped
            dropped = drop_kernel_caches()
            with TieredStore.open(cfg, ns) as store:
                t = time.perf_counter()
                r = store.lookup(keys)
                res["lookup_disk_cold_ms_128_chunks"] = round((time.perf_counter() - t) * 1e3, 4)
                res["lookup_disk_cold_caches_dropped"] = dropped
                assert r.num_chunks == 128
        with TieredStore.open(cfg, ns) as store:
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                r = store.lookup(keys)
                ts.append(time.perf_counter() - t)
            assert r.num_chunks == 128
        res[f"lookup_{where}_ms_128_chunks"] = round(statistics.median(ts) * 1e3, 4)
        res[f"lookup_{where}_p99_ms"] = round(percentile_ms(ts, 99), 4)
        res[f"lookup_{where}_max_ms"] = round(max(ts) * 1e3, 4)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    res["lookup_ms_128_chunks"] = res["lookup_disk_ms_128_chunks"]
    res["lookup_reps"] = reps
    res["keys_ms_32k_tokens_numpy"] = round(statistics.median(t_hash) * 1e3, 4)
    res["keys_ms_32k_tokens_list"] = round(statistics.median(t_hash_list) * 1e3, 4)
    return res


def drop_kernel_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (page cache, dentries, inodes); False when not
    allowed (not root, a container without it)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def bench_recovery(path: Path, n: int) -> dict:
    """Time DiskTier.open (index rebuild) over n chunk files: first without a manifest
    (every header read), then with the manifest written by close()."""
    from kvtier.chunk import encode
    ns = Namespace("bench", f"recovery{n}", "bfloat16", "bench", 16, TOKENS)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    tier = DiskTier.open(path, ns, capacity=2**40, telemetry=Telemetry())
    keys = chunk_keys(ns, np.arange(n * TOKENS, dtype=np.uint32))
    for i, k in enumerate(keys):   # tiny chunks written directly: we time the index, not the data
        p = tier.path_of(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, encode(ns.digest(), ChunkMeta(k, keys[i - 1] if i else None, TOKENS, (8,), "uint8", 8), b"x" * 8))
        os.close(fd)
    tier.close()
    os.unlink(path / ns.short_id() / "manifest")
    t0 = time.perf_counter()
    tier = DiskTier.open(path, ns, capacity=2**40, telemetry=Telemetry())
    cold = time.perf_counter() - t0
    assert tier.usage().num_chunks == n
    tier.close()
    t0 = time.perf_counter()
    tier = DiskTier.open(path, ns, capacity=2**40, telemetry=Telemetry())
    warm = time.perf_counter() - t0
    tier.close()
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    return {"chunks": n, "open_s_no_manifest": round(cold, 3), "open_s_with_manifest": round(warm, 3)}
