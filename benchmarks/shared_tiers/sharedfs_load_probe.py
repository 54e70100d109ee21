"""Where does a shared-filesystem hit spend its time? The engine's load path without the engine.

    timeout 600 .venv/bin/python benchmarks/shared_tiers/sharedfs_load_probe.py \
        --chunks 30 --docs 3 --json /tmp/probe.json [--scenarios default-loader2,...]

A JuiceFS volume (metadata in Valkey, data in a local directory; tests/services) is written through
mount a ("machine A": ``SharedFsTier.put``, chunks of the demo's size, chained) and read, per
scenario, through a FRESH mount ("machine B": its own empty ``--cache-dir``), the volume's data
directory evicted from the page cache before each document — as ``kvtier demo longdoc --shared``.
A scenario = mount options x reader:

* ``raw``: one thread, whole-file ``preadv`` per chunk (the mount's own ceiling for one stream);
* ``loaderN``: the worker's asynchronous load (``AsyncLoader`` over ``TieredStore.read_into`` via
  ``GuardedTier`` -> ``SharedFsTier``, N chunk reads in flight, block copy = a memcpy, promotion
  into the RAM tier in request order), after the scheduler's ``shared_prefix`` lookup;
* ``+spin``: meanwhile a thread of this process polls in a ``sched_yield`` loop (what vLLM's worker
  main thread does between engine steps: ``MessageQueue.acquire_read``) — an engine whose idle
  steps do not wait;
* ``batch``: one ``TieredStore.read_into`` of the whole document (``max_inflight`` threads).

``pin``: the process (all its threads) on CPU 0, as vLLM-cpu binds its worker. Per document: wall
seconds, MB/s, CPU seconds of the JuiceFS client of mount b and of this process, bytes the client
wrote into its cache dir. Side effects: starts and stops its own servers/mounts in a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "sharedfs"))

CHUNK_TOKENS = 128
CHUNK_BYTES = 46_080 * CHUNK_TOKENS          # SmolLM2-135M float32: 46,080 KV bytes per token

#: name -> (extra `juicefs mount` options of mount b, reader, pinned to CPU 0)
SCENARIOS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "default-raw": ((), "raw", False),
    "default-loader2": ((), "loader2", False),
    "default-loader2-pin": ((), "loader2", True),
    "default-batch-pin": ((), "batch", True),
    "nocache-loader2-pin": (("--cache-size", "0"), "loader2", True),
    "nocache-batch-pin": (("--cache-size", "0"), "batch", True),
    "nocache-loader8-pin": (("--cache-size", "0"), "loader8", True),
    "default-loader2-pin-spin": ((), "loader2+spin", True),
    "default-loader8-pin": ((), "loader8", True),
}


def proc_cpu(pid: int) -> float:
    """utime + stime (s) of ``pid`` and its children threads (a process's /proc/PID/stat counts all)."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def client_pids(mount) -> list[int]:
    from kvtier.services.juicefs import _children
    return [mount.pid, *_children(mount.pid)]


def disk_io() -> tuple[float, float]:
    """MB read and written so far by the block devices holding / (whole disks in /proc/diskstats)."""
    r = w = 0
    for line in open("/proc/diskstats"):
        f = line.split()
        if f[2].startswith(("vd", "sd", "nvme", "xvd")) and not f[2][-1].isdigit() or f[2].endswith("n1"):
            r, w = r + int(f[5]), w + int(f[9])
    return r * 512 / 1e6, w * 512 / 1e6


def dirty_mb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("Dirty:"):
            return int(line.split()[1]) / 1e3
    return 0.0


class StatsSampler:
    """Samples the JuiceFS client's own gauges (``<mount>/.stats``) every 0.2 s while a document
    loads: the read buffer it holds and its RSS (first, max, last, in MB)."""

    KEYS = ("juicefs_used_buffer_size_bytes", "juicefs_used_read_buffer_size_bytes", "juicefs_memory")

    def __init__(self, mount: Path) -> None:
        self.path, self.seen = mount / ".stats", {k: [] for k in self.KEYS}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _sample(self) -> None:
        try:
            for line in self.path.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k in self.seen:
                    self.seen[k].append(float(v) / 1e6)
        except (OSError, ValueError):
            pass

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self._sample()
        return {k.removeprefix("juicefs_"): {"first": round(v[0]), "max": round(max(v)), "last": round(v[-1])}
                for k, v in self.seen.items() if v}


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=30, help="chunks per document (30 = a 3.8K-token document)")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--gap", type=float, default=0.0,
                    help="seconds between documents (the demo's are ~15-20 s apart: a recompute-free hit, "
                         "then the next question)")
    ap.add_argument("--touch-interval", type=float, default=60.0,
                    help="store.shared.touch_interval_s of the reader (a hit on a chunk whose access stamp is "
                         "older refreshes it: 0 = every hit touches)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    names = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    for n in names:
        if n not in SCENARIOS:
            print(f"unknown scenario {n!r}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
            return 2
    import numpy as np

    from common import juicefs_volume
    from kvtier.bench.shared_seed import evict
    from kvtier.chunk import ChunkMeta
    from kvtier.config import SharedFsConfig, StoreConfig
    from kvtier.integrations.vllm.async_loads import AsyncLoader
    from kvtier.integrations.vllm.metadata import LoadChunk, LoadPlan
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.metrics import Telemetry
    from kvtier.store import TieredStore
    from kvtier.tiers.protocol import Deadline
    from kvtier.tiers.sharedfs import SharedFsTier

    ns = Namespace("probe", "f", "float32", "L", 16, CHUNK_TOKENS)
    rng = np.random.default_rng(0)
    docs = [chunk_keys(ns, rng.integers(0, 50_000, a.chunks * CHUNK_TOKENS).tolist()) for _ in range(a.docs)]
    payload = memoryview(rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes())
    out: dict = {"chunk_bytes": CHUNK_BYTES, "chunks_per_doc": a.chunks, "docs": a.docs, "scenarios": {}}
    all_cpus = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="kvtier-probe-") as tmp, juicefs_volume(Path(tmp) / "jfs") as (fs, _m):
        ma = fs.mount("a")
        (ma.path / "kv").mkdir()
        w = SharedFsTier.open(SharedFsConfig(path=ma.path / "kv", janitor=False, io_timeout_s=60,
                                             lookup_timeout_s=30), ns, Telemetry())
        t0 = time.perf_counter()
        for keys in docs:
            for i, k in enumerate(keys):
                assert w.put(ChunkMeta(k, keys[i - 1] if i else None, CHUNK_TOKENS, (CHUNK_BYTES,), "uint8",
                                       CHUNK_BYTES), payload)
        w.close()
        out["write_s"] = round(time.perf_counter() - t0, 2)
        print(f"wrote {a.docs * a.chunks} chunks through mount a in {out['write_s']} s", flush=True)
        bucket = fs.root / "bucket"
        for si, name in enumerate(names):
            extra, reader, pin = SCENARIOS[name]
            mb = fs.mount(f"b{si}", extra=list(extra))
            end = time.time() + 30
            while not (mb.path / "kv").is_dir() and time.time() < end:
                time.sleep(0.05)
            os.sched_setaffinity(0, {min(all_cpus)} if pin else all_cpus)   # threads made from now inherit it
            cfg = StoreConfig(chunk_size=CHUNK_TOKENS, memory={"capacity": 2 * 2**30},
                              shared={"kind": "sharedfs", "path": str(mb.path / "kv"), "janitor": False,
                                      "lookup_timeout_s": 10.0, "io_timeout_s": 60.0,
                                      "touch_interval_s": a.touch_interval})
            store = TieredStore.open(cfg, ns)
            rows = []
            for di, keys in enumerate(docs):
                if di and a.gap:
                    time.sleep(a.gap)
                evict([str(bucket)])
                sampler = StatsSampler(mb.path)
                c0 = sum(proc_cpu(p) for p in client_pids(mb))
                dirty0, (dr0, dw0) = dirty_mb(), disk_io()
                cpu0, cache0, t0 = proc_cpu(os.getpid()), dir_bytes(mb.cache_dir), time.perf_counter()
                lookup_s = read_s = 0.0
                if reader == "raw":
                    buf = memoryview(bytearray(CHUNK_BYTES + 8192))
                    for k in keys:
                        p = store.remote[0].inner.layout.path_of(k) if hasattr(store.remote[0], "inner") \
                            else store.remote[0].layout.path_of(k)
                        fd = os.open(p, os.O_RDONLY)
                        try:
                            got = 0
                            while (n := os.preadv(fd, [buf[got:]], got)) > 0:
                                got += n
                        finally:
                            os.close(fd)
                    ok = len(keys)
                else:
                    pr = store.shared_prefix(keys, Deadline.after(10))
                    lookup_s = time.perf_counter() - t0
                    assert pr.num_chunks == len(keys), pr
                    if reader == "batch":
                        bufs = [memoryview(bytearray(CHUNK_BYTES)) for _ in keys]
                        res = store.read_into(keys, bufs, Deadline.after(60), promote=True)
                        ok = sum(r.ok for r in res)
                    else:
                        depth = int(reader.removeprefix("loader").removesuffix("+spin"))
                        stop_spin = threading.Event()
                        if reader.endswith("+spin"):
                            def spin() -> None:
                                while not stop_spin.is_set():
                                    os.sched_yield()
                            threading.Thread(target=spin, daemon=True).start()
                        sink = bytearray(CHUNK_BYTES)

                        def scatter(_ids, _first, b) -> None:
                            sink[:] = memoryview(b)[:CHUNK_BYTES]

                        def read(key, b, dl):
                            m = store.get_meta_into(key, memoryview(b), promote=False, deadline=Deadline(dl))
                            return (m is not None), (None if m else "miss"), m

                        ld = AsyncLoader(read, scatter, lambda: bytearray(CHUNK_BYTES), block_size=16,
                                         load_timeout_s=60, depth=depth,
                                         promote=lambda m, b: store.promote(m, memoryview(b)))
                        ld.submit(LoadPlan(f"d{di}", 0, len(keys) * CHUNK_TOKENS,
                                           tuple(LoadChunk(k, tuple(range(8 * i, 8 * i + 8))) for i, k in
                                                 enumerate(keys)), async_load=True))
                        assert ld.wait_idle(120)
                        stop_spin.set()
                        d = ld.take_done()[0]
                        ld.close()
                        ok = d.outcome.loaded_tokens // CHUNK_TOKENS
                dt = time.perf_counter() - t0
                jfs = sampler.stop()
                dr1, dw1 = disk_io()
                read_s = dt - lookup_s
                row = {"doc": di, "seconds": round(dt, 3), "lookup_s": round(lookup_s, 3),
                       "MBps": round(len(keys) * CHUNK_BYTES / 1e6 / read_s, 1), "chunks_ok": ok,
                       "client_cpu_s": round(sum(proc_cpu(p) for p in client_pids(mb)) - c0, 2),
                       "probe_cpu_s": round(proc_cpu(os.getpid()) - cpu0, 2),
                       "cache_dir_written_MB": round((dir_bytes(mb.cache_dir) - cache0) / 1e6, 1),
                       "dirty_MB_before": round(dirty0), "disk_read_MB": round(dr1 - dr0),
                       "disk_written_MB": round(dw1 - dw0), "juicefs": jfs}
                rows.append(row)
                print(f"{name:24s} doc {di}: {row}", flush=True)
            store.close()
            os.sched_setaffinity(0, all_cpus)
            time.sleep(1.0)   # async cache writes land before the cache dir is measured
            out["scenarios"][name] = {"mount_options": list(extra), "reader": reader, "pinned_cpu0": pin,
                                      "docs": rows, "cache_dir_MB_after": round(dir_bytes(mb.cache_dir) / 1e6, 1)}
            mb.umount()
    out["loadavg"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
