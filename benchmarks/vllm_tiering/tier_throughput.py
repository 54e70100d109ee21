"""Store and load throughput of kvtier's vLLM secondary tier, against kvtier's own store on the same
backend and vLLM's own ``fs`` tier on the same directory, in one run.

    flock /tmp/kvtier-heavy.lock .venv/bin/python benchmarks/vllm_tiering/tier_throughput.py \
        --backends disk,juicefs --rounds 5 --out benchmarks/results/vllm-tiering/<date>-<cpu-class>

vLLM's job pattern: a primary region of Llama-3-8B-shaped chunks (32 layers x 8 KV heads x 128 x
K and V x bf16 = 128 KiB per token; ``--chunk-tokens`` 16, vLLM's default of one GPU block per chunk:
2 MiB), jobs of ``--job-chunks`` chunks, ``--jobs`` jobs submitted at once and polled as the
scheduler polls (``get_finished_jobs``). Three sides, each on a fresh directory of the same backend,
in rotating order within every round:

* **kvtier tier**: ``KvtierSecondaryTier`` built by vLLM's ``SecondaryTierFactory``; a store pass
  ends when every job was reported and kvtier's background writes are flushed (``store.flush``);
* **kvtier store**: ``TieredStore`` with the same config driven directly, one job per thread
  (``put`` per chunk, then ``flush``; loads: one ``read_into`` per job), as many threads as the tier
  has job threads;
* **vLLM fs**: vLLM's ``FileSystemTierManager`` with its default threads (16 read, 16 write).

Backends: ``disk`` (kvtier's SSD tier; vLLM ``fs`` on the same local directory) and ``juicefs``
(kvtier's shared-filesystem tier; vLLM ``fs`` on the same JuiceFS directory), a volume started here
(metadata in Valkey, data in a local directory) with two mounts: written through mount ``a``, read
back through mount ``b`` by fresh tier instances ("the other machine", empty client cache). On
``disk`` the chunk files are evicted from the page cache before each load pass. Each round's GB/s
is its payload bytes over its wall time; figures are medians over rounds, ratios the medians of the
per-round ratios; one unrecorded warm-up pass per side comes first. Loaded bytes are checked against the stored ones after each pass.
"""

from __future__ import annotations

import argparse
import json
import mmap
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtier.bench.store_bench_files import drop_page_cache, machine  # noqa: E402
from kvtier.integrations.vllm_tiering.namespace import offload_namespace  # noqa: E402
from kvtier.integrations.vllm_tiering.settings import TierSettings  # noqa: E402
from kvtier.keys import ChunkKey  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.tiers.protocol import Deadline  # noqa: E402

KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2          # Llama-3-8B, bf16
SIDES = ("kvtier tier", "kvtier store", "vLLM fs")


def offloading_config(chunk_bytes: int, chunk_tokens: int, num_chunks: int):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=chunk_tokens,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(32)),
                                      group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * chunk_bytes},
        engine_id=f"kvtier-bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="meta-llama/Meta-Llama-3-8B-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=chunk_tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
        kv_cache_layout="NHD")


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.chunk_tokens = a.chunk_tokens
        self.chunk_bytes = a.chunk_tokens * KV_BYTES_PER_TOKEN
        self.n = a.jobs * a.job_chunks
        self.cfg = offloading_config(self.chunk_bytes, self.chunk_tokens, 2 * self.n)
        region = mmap.mmap(-1, 2 * self.n * self.chunk_bytes)      # page-aligned, as vLLM's primary region
        self.arr = np.frombuffer(region, dtype=np.int8).reshape(2 * self.n, self.chunk_bytes)
        rng = np.random.default_rng(0)
        for i in range(self.n):
            self.arr[i] = rng.integers(-128, 128, self.chunk_bytes, dtype=np.int8)
        self.expected = [self.arr[i].tobytes() for i in range(self.n)]
        self.seq = 0

    def spec(self):
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        return TieringOffloadingSpec(self.cfg)

    def kvtier_store_cfg(self, backend: str, path: Path) -> dict:
        if backend == "disk":
            return {"store": {"disk": {"enabled": True, "path": str(path), "capacity": "8GiB",
                                       "queue_depth": 4 * self.n}}}
        return {"store": {"shared": {"kind": "sharedfs", "path": str(path), "create": True, "capacity": "8GiB",
                                     "janitor": False, "queue_depth": 4 * self.n, "io_timeout_s": 60}}}

    def tier(self, side: str, backend: str, path: Path):
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        if side == "vLLM fs":
            entry = {"type": "fs", "root_dir": str(path)}
        else:
            entry = {"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm_tiering",
                     "kvtier_config": self.kvtier_store_cfg(backend, path), "job_threads": self.a.job_threads}
        tier = SecondaryTierFactory.create_secondary_tier(entry, memoryview(self.arr), self.spec())
        if side == "kvtier tier":
            tier.open()            # outside the timed passes, as vLLM's fs tier opens in its constructor
        return tier

    def store(self, backend: str, path: Path) -> TieredStore:
        settings = TierSettings.from_entry(None, self.kvtier_store_cfg(backend, path), False, None,
                                           self.a.job_threads, env={})
        ns = offload_namespace(self.cfg, self.chunk_bytes, "bench-store")
        return TieredStore.open(settings.store_config(self.chunk_tokens), ns)

    def keys(self) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key

        self.seq += 1
        return [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(self.n)]

    def jobs(self, ks: list[bytes], base: int):
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        j = self.a.job_chunks
        return [TransferJob(job_id=self.seq * 10_000 + i, keys=ks[i * j:(i + 1) * j],
                            chunk_ids=np.arange(base + i * j, base + (i + 1) * j, dtype=np.int32),
                            is_promotion=base > 0, req_context=ReqContext(req_id=f"r{i}"))
                for i in range(self.a.jobs)]

    @staticmethod
    def run_jobs(tier, jobs, load: bool) -> tuple[float, bool]:
        t0 = time.perf_counter()
        for job in jobs:
            (tier.submit_load if load else tier.submit_store)(job)
        left, ok = {j.job_id for j in jobs}, True
        while left:
            for r in tier.get_finished_jobs():
                left.discard(r.job_id)
                ok = ok and r.success
            time.sleep(0.0005)
        if not load and hasattr(tier, "store"):
            ok = tier.store.flush(120) and ok
        return time.perf_counter() - t0, ok

    def store_side(self, st: TieredStore, ks: list[bytes], load: bool) -> tuple[float, bool]:
        from kvtier.integrations.vllm_tiering.namespace import offload_chunk_key

        cks = [ChunkKey(offload_chunk_key(st.namespace, k)) for k in ks]
        j, flat = self.a.job_chunks, memoryview(self.arr).cast("B")
        row = lambda c: flat[c * self.chunk_bytes:(c + 1) * self.chunk_bytes]  # noqa: E731

        def put_job(i: int) -> bool:
            return all([st.put(cks[c], None, row(c), num_tokens=self.chunk_tokens, shape=(self.chunk_bytes,),
                               dtype="uint8") for c in range(i * j, (i + 1) * j)])

        def read_job(i: int) -> bool:
            res = st.read_into(cks[i * j:(i + 1) * j], [row(self.n + c) for c in range(i * j, (i + 1) * j)],
                               Deadline.after(60))
            return all(r.ok for r in res)

        with ThreadPoolExecutor(self.a.job_threads) as ex:
            t0 = time.perf_counter()
            ok = all(ex.map(read_job if load else put_job, range(self.a.jobs)))
            if not load:
                ok = st.flush(120) and ok
            return time.perf_counter() - t0, ok

    def check(self) -> bool:
        return all(self.arr[self.n + i].tobytes() == self.expected[i] for i in range(self.n))

    def one(self, side: str, backend: str, write_dir: Path, read_dir: Path) -> dict:
        ks = self.keys()
        self.arr[self.n:] = 0
        if side == "kvtier store":
            st = self.store(backend, write_dir)
            put_s, put_ok = self.store_side(st, ks, load=False)
            st.close()
            self.evict(backend, write_dir)
            self.visible(write_dir, read_dir)
            st = self.store(backend, read_dir)
            get_s, get_ok = self.store_side(st, ks, load=True)
            st.close()
        else:
            t = self.tier(side, backend, write_dir)
            put_s, put_ok = self.run_jobs(t, self.jobs(ks, 0), load=False)
            t.shutdown()
            self.evict(backend, write_dir)
            self.visible(write_dir, read_dir)
            t = self.tier(side, backend, read_dir)
            get_s, get_ok = self.run_jobs(t, self.jobs(ks, self.n), load=True)
            t.shutdown()
        gb = self.n * self.chunk_bytes / 1e9
        return {"store_gbps": round(gb / put_s, 3), "load_gbps": round(gb / get_s, 3),
                "ok": bool(put_ok and get_ok and self.check())}

    def evict(self, backend: str, path: Path) -> None:
        if backend == "disk":
            drop_page_cache([str(p) for p in path.rglob("*") if p.is_file()])

    @staticmethod
    def visible(write_dir: Path, read_dir: Path, timeout: float = 60.0) -> None:
        """Wait (untimed) until the reading mount lists every file the writing mount wrote (a JuiceFS
        client caches directory entries for about a second)."""
        if write_dir == read_dir:
            return
        want = {p.relative_to(write_dir) for p in write_dir.rglob("*") if p.is_file()}
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if read_dir.is_dir() and want <= {p.relative_to(read_dir) for p in read_dir.rglob("*") if p.is_file()}:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{read_dir} does not show the files written through {write_dir}")


def juicefs_dirs(stack: ExitStack, tmp: Path) -> tuple[Path, Path]:
    from kvtier.services.juicefs import JuiceFs
    from kvtier.services.valkey_server import ValkeyServer

    meta = ValkeyServer.start(tmp, password="bench-meta-secret", policy="noeviction", name="juicefs-meta")
    stack.callback(meta.stop)
    fs = JuiceFs.start(tmp, meta)
    stack.callback(fs.stop)
    a, b = fs.mount("a"), fs.mount("b")
    return a.path, b.path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="disk,juicefs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=16)
    ap.add_argument("--job-chunks", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--job-threads", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="local directory for the disk backend (default: a temp dir)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    bench = Bench(a)
    report: dict = {"chunk_bytes": bench.chunk_bytes, "chunk_tokens": a.chunk_tokens, "job_chunks": a.job_chunks,
                    "jobs": a.jobs, "job_threads": a.job_threads, "rounds": a.rounds, "backends": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-tier-bench-", dir=a.dir) as tmp, ExitStack() as stack:
        tmp_p = Path(tmp)
        report["machine"] = machine(tmp_p)
        for backend in [b.strip() for b in a.backends.split(",") if b.strip()]:
            if backend == "juicefs":
                wa, wb = juicefs_dirs(stack, tmp_p / "jfs")
            else:
                wa = wb = tmp_p / "disk"
            rows: dict[str, list[dict]] = {s: [] for s in SIDES}
            for side in SIDES:                               # warm-up pass per side, not recorded
                (wa / "warm").mkdir(parents=True, exist_ok=True)
                bench.one(side, backend, wa / "warm", wb / "warm")
                shutil.rmtree(wa / "warm", ignore_errors=True)
            for r in range(a.rounds):
                order = SIDES[r % 3:] + SIDES[:r % 3]
                for side in order:
                    sub = f"r{r}-{side.replace(' ', '-')}"
                    (wa / sub).mkdir(parents=True, exist_ok=True)
                    rows[side].append(bench.one(side, backend, wa / sub, wb / sub))
                    shutil.rmtree(wa / sub, ignore_errors=True)
                    print(backend, r, side, rows[side][-1], flush=True)
            report["backends"][backend] = summarize(rows)
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "tier_throughput.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({b: v["summary"] for b, v in report["backends"].items()}, indent=2))
    return 0


def summarize(rows: dict[str, list[dict]]) -> dict:
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    summary: dict = {}
    for side, rs in rows.items():
        summary[side] = {"store_gbps": med([x["store_gbps"] for x in rs]),
                         "load_gbps": med([x["load_gbps"] for x in rs]), "all_ok": all(x["ok"] for x in rs)}
    for other, name in (("kvtier store", "vs_store"), ("vLLM fs", "vs_fs")):
        for k in ("store_gbps", "load_gbps"):
            summary[f"{k.split('_')[0]}_{name}"] = med([t[k] / o[k] for t, o in zip(rows["kvtier tier"], rows[other])])
    return {"rounds": rows, "summary": summary}


if __name__ == "__main__":
    raise SystemExit(main())
