"""Shared pieces of the sharedfs benchmarks: populate a tier directory with many chunk files
(sparse, so only the metadata costs), time lookups, start a two-mount JuiceFS volume."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtier.chunk import file_size  # noqa: E402
from kvtier.config import SharedFsConfig  # noqa: E402
from kvtier.keys import Namespace, chunk_keys  # noqa: E402
from kvtier.metrics import Telemetry  # noqa: E402
from kvtier.tiers.protocol import Deadline  # noqa: E402
from kvtier.tiers.sharedfs import SharedFsTier  # noqa: E402
from kvtier.tiers.sharedfs.layout import Layout  # noqa: E402

NS = Namespace("bench", "f", "float32", "L", 16, 128)
CHAIN = 256                      # a 32K-token prompt in chunks of 128 tokens
PAYLOAD = 64                     # "small payloads": the metadata is what is measured
SIZE = file_size(PAYLOAD)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} vCPU"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def chains(n_files: int, seed: int = 0) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range((n_files + CHAIN - 1) // CHAIN):
        toks = rng.integers(0, 50_000, size=CHAIN * NS.chunk_size).tolist()
        out.append(chunk_keys(NS, toks))
    return out


def populate(base: Path, all_chains: list[list[bytes]], threads: int, levels: int = 2) -> float:
    """Create every chain's files (sparse, SIZE bytes) with stamps that age chain by chain and,
    inside a chain, from head to tail (the tier's invariant). Returns seconds taken."""
    layout = Layout(base, NS, levels)
    layout.ensure_root(NS)
    t0 = time.perf_counter()
    now = time.time_ns()

    def one_chain(ci: int) -> None:
        made: set[str] = set()
        for i, key in enumerate(all_chains[ci]):
            path = layout.path_of(key)
            d = os.path.dirname(path)
            if d not in made:
                os.makedirs(d, exist_ok=True)
                made.add(d)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, SIZE)
            os.close(fd)
            stamp = now - (len(all_chains) - ci) * 10**6 - i * 1000
            os.utime(path, ns=(stamp, stamp))

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one_chain, range(len(all_chains))))
    return time.perf_counter() - t0


def open_tier(base: Path, **kw) -> SharedFsTier:
    cfg = SharedFsConfig(path=base, janitor=False, lookup_timeout_s=30, io_timeout_s=60, **kw)
    return SharedFsTier.open(cfg, NS, Telemetry())


def time_lookups(tier: SharedFsTier, sample: list[list[bytes]]) -> list[float]:
    """Milliseconds per 256-chunk lookup (each must find the whole chain)."""
    out = []
    for keys in sample:
        t0 = time.perf_counter()
        r = tier.longest_prefix(keys, Deadline.after(30))
        out.append((time.perf_counter() - t0) * 1e3)
        assert r.num_chunks == len(keys), r
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(xs: list[float]) -> dict:
    return {"p50": round(statistics.median(xs), 3), "p99": round(pct(xs, 0.99), 3), "n": len(xs)}


@contextlib.contextmanager
def juicefs_volume(tmp: Path | None = None) -> Iterator[tuple[object, object]]:
    """(JuiceFs, its meta ValkeyServer), started from the test harness; stopped on exit."""
    from kvtier.services.juicefs import JuiceFs
    from kvtier.services.valkey_server import ValkeyServer

    tmp = Path(tmp or tempfile.mkdtemp(prefix="kvtier-sfs-bench-"))
    meta = ValkeyServer.start(tmp, password="bench-meta", policy="noeviction", name="juicefs-meta")
    fs = None
    try:
        fs = JuiceFs.start(tmp, meta)
        yield fs, meta
    finally:
        if fs is not None:
            fs.stop()
        meta.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
