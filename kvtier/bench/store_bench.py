"""``kvtier bench store``: store throughput/latency per tier against raw limits measured in the same run.

Per model chunk size (default model: 23,040 B/token x 256 tokens; 7B-class: 57,344 B/token):

* memory: ``MemoryTier`` put / ``get_into`` (reused, pre-faulted output buffer) vs a
  plain memcpy of the same bytes from a pre-faulted slab into the same buffer.
* disk: ``DiskTier`` sequential put (write temp + publish) and ``get_into`` of every
  chunk after the files were dropped from the page cache (fsync + POSIX_FADV_DONTNEED),
  vs raw sequential O_DIRECT write/read of the same volume in chunk-sized blocks
  (fio when installed, else the same I/O done raw here). Run once with O_DIRECT
  (apples to apples with the raw figures) and once buffered (page cache, fsync=never).
* lookup: ``TieredStore.lookup`` of a 32K-token prompt (128 chunks) held on disk
  (one stat per chunk: the worst case) and in RAM, and key hashing separately.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from kvtier.chunk import ChunkMeta
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.diskio import ALIGN, open_direct
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier

MODELS = {"default": 23_040, "7b": 57_344}      # KV bytes per token
TOKENS = 256
GB = 1e9


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] * 1e3


def _lat(xs: list[float]) -> dict:
    return {"p50_ms": round(_pct(xs, 50), 3), "p99_ms": round(_pct(xs, 99), 3)}


def _aligned(n: int) -> memoryview:
    import mmap
    m = mmap.mmap(-1, (n + ALIGN - 1) // ALIGN * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return memoryview(m)


def _drop_cache(paths: list[str]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ns(chunk_bytes: int) -> Namespace:
    return Namespace("bench", f"chunk{chunk_bytes}", "bfloat16", "bench", 16, TOKENS)


def bench_memory(chunk: int, n: int, passes: int) -> dict:
    rng = np.random.default_rng(0)
    src = _aligned(chunk)
    src[:] = rng.integers(0, 256, chunk, dtype=np.uint8).tobytes()
    out = _aligned(chunk)
    slab = _aligned(chunk * n)
    # raw put: memcpy the source into slot i of a pre-faulted slab (this also fills the slab
    # with real data, so the get baseline does not read the shared zero page)
    t0 = time.perf_counter()
    for _ in range(passes):
        for i in range(n):
            slab[i * chunk:(i + 1) * chunk] = src
    memcpy_put = passes * n * chunk / (time.perf_counter() - t0) / GB
    # raw get: memcpy slot i into the same pre-faulted output buffer
    t0 = time.perf_counter()
    for _ in range(passes):
        for i in range(n):
            out[:chunk] = slab[i * chunk:(i + 1) * chunk]
    memcpy = passes * n * chunk / (time.perf_counter() - t0) / GB
    slab.release()
    tier = MemoryTier.open(n * ((chunk + 4095) // 4096 * 4096), prefault=True, telemetry=Telemetry())
    keys = chunk_keys(_ns(chunk), np.arange(n * TOKENS))
    metas = [ChunkMeta(k, None, TOKENS, (chunk,), "uint8", chunk) for k in keys]
    put_t, get_t = [], []
    t0 = time.perf_counter()
    for m in metas:        # first fill: allocates (and with prefault populates) the slab once
        assert tier.put(m, src)
    first_fill = n * chunk / (time.perf_counter() - t0) / GB
    for rnd in range(passes):
        for k in keys:
            tier.delete(k)
        for m in metas:
            t = time.perf_counter()
            assert tier.put(m, src)
            put_t.append(time.perf_counter() - t)
    for _ in range(passes):
        for k in keys:
            t = time.perf_counter()
            assert tier.get_into(k, out) is not None
            get_t.append(time.perf_counter() - t)
    tier.close()
    return {"memcpy_gbps": round(memcpy, 3), "memcpy_put_gbps": round(memcpy_put, 3), "put_gbps": round(len(put_t) * chunk / sum(put_t) / GB, 3),
            "get_gbps": round(len(get_t) * chunk / sum(get_t) / GB, 3),
            "first_fill_gbps": round(first_fill, 3), "put": _lat(put_t), "get": _lat(get_t), "chunks": n,
            "passes": passes}


def raw_disk(path: Path, chunk: int, n: int) -> dict:
    """Sequential O_DIRECT write then read of n chunk-sized blocks (fio when available)."""
    f = path / "raw.bin"
    if shutil.which("fio"):
        res = {}
        for rw in ("write", "read"):
            cmd = ["fio", "--name=raw", f"--filename={f}", f"--rw={rw}", f"--bs={chunk // ALIGN * ALIGN}",
                   f"--size={n * (chunk // ALIGN * ALIGN)}", "--direct=1", "--ioengine=psync",
                   "--output-format=json", "--end_fsync=1"]
            out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            res[f"raw_{rw}_gbps"] = round(out["jobs"][0][rw]["bw_bytes"] / GB, 3)
        f.unlink()
        return {**res, "raw_tool": "fio"}
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    buf = _aligned(block)
    buf[:] = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8).tobytes()
    fd, direct = open_direct(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)
    t0 = time.perf_counter()
    for i in range(n):
        os.pwrite(fd, buf, i * block)
    os.fsync(fd)
    w = n * block / (time.perf_counter() - t0) / GB
    os.close(fd)
    _drop_cache([str(f)])
    fd, _ = open_direct(str(f), os.O_RDONLY, True)
    t0 = time.perf_counter()
    for i in range(n):
        os.preadv(fd, [buf], i * block)
    r = n * block / (time.perf_counter() - t0) / GB
    os.close(fd)
    f.unlink()
    return {"raw_write_gbps": round(w, 3), "raw_read_gbps": round(r, 3), "raw_tool": "python" + ("" if direct else "-buffered")}


def bench_disk(path: Path, chunk: int, n: int, o_direct: bool) -> dict:
    ns = _ns(chunk)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    tier = DiskTier.open(path, ns, capacity=n * (chunk + 8192) + 2**20, o_direct=o_direct, telemetry=Telemetry())
    src = _aligned(chunk)
    src[:] = np.random.default_rng(2).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    out = _aligned(chunk)
    keys = chunk_keys(ns, np.arange(n * TOKENS))
    put_t, get_t = [], []
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        assert tier.write(ChunkMeta(k, None, TOKENS, (chunk,), "uint8", chunk), src)
        put_t.append(time.perf_counter() - t)
    if o_direct:
        os.sync()
    put_wall = time.perf_counter() - t0
    _drop_cache([tier.path_of(k) for k in keys])
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        assert tier.get_into(k, out) is not None
        get_t.append(time.perf_counter() - t)
    get_wall = time.perf_counter() - t0
    tier.close()
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    return {"put_gbps": round(n * chunk / put_wall / GB, 3), "get_gbps": round(n * chunk / get_wall / GB, 3),
            "put": _lat(put_t), "get": _lat(get_t), "o_direct": o_direct, "chunks": n}


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
    for _ in range(reps // 4):
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
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                r = store.lookup(keys)
                ts.append(time.perf_counter() - t)
            assert r.num_chunks == 128
        res[f"lookup_{where}_ms_128_chunks"] = round(statistics.median(ts) * 1e3, 4)
        res[f"lookup_{where}_p99_ms"] = round(_pct(ts, 99), 4)
    shutil.rmtree(path / ns.short_id(), ignore_errors=True)
    res["lookup_ms_128_chunks"] = res["lookup_disk_ms_128_chunks"]
    res["keys_ms_32k_tokens_numpy"] = round(statistics.median(t_hash) * 1e3, 4)
    res["keys_ms_32k_tokens_list"] = round(statistics.median(t_hash_list) * 1e3, 4)
    return res


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


def machine(path: Path) -> dict:
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "?")
    df = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "mem_total_kib": int(mem), "kernel": platform.release(),
            "python": platform.python_version(), "df": df, "fs_type": df.splitlines()[-1].split()[1] if df else "?",
            "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")}


def run(path: Path, volume: int, quick: bool, log=print) -> dict:
    path.mkdir(parents=True, exist_ok=True)
    info = machine(path)
    if info["fs_type"] == "tmpfs":
        log(f"warning: {path} is on tmpfs: disk figures measure RAM, not an SSD")
    result: dict = {"machine": info, "volume_bytes": volume, "quick": quick, "models": {}}
    for name, per_token in MODELS.items():
        chunk = per_token * TOKENS
        n = max(4, volume // chunk)
        log(f"[{name}] chunk {chunk / 2**20:.2f} MiB x {n} chunks")
        mem = bench_memory(chunk, min(n, max(4, (1 << 30) // chunk)), passes=2 if quick else 3)
        raw = raw_disk(path, chunk, n)
        direct = bench_disk(path, chunk, n, o_direct=True)
        buffered = bench_disk(path, chunk, n, o_direct=False)
        disk = {"get_gbps": direct["get_gbps"], "put_gbps": direct["put_gbps"], **raw,
                "get": direct["get"], "put": direct["put"], "chunks": n}
        disk["get_vs_raw_read"] = round(disk["get_gbps"] / raw["raw_read_gbps"], 3)
        disk["put_vs_raw_write"] = round(disk["put_gbps"] / raw["raw_write_gbps"], 3)
        mem["get_vs_memcpy"] = round(mem["get_gbps"] / mem["memcpy_gbps"], 3)
        result["models"][name] = {"chunk_bytes": chunk, "memory": mem, "disk": disk, "disk_buffered": buffered}
        log(f"  memory get {mem['get_gbps']:.2f} GB/s = {mem['get_vs_memcpy']:.2f}x memcpy {mem['memcpy_gbps']:.2f}"
            f" (target >= 0.5x); put {mem['put_gbps']:.2f} GB/s vs memcpy into slots {mem['memcpy_put_gbps']:.2f}; get p50/p99 {mem['get']['p50_ms']}/{mem['get']['p99_ms']} ms")
        log(f"  disk   get {disk['get_gbps']:.2f} GB/s = {disk['get_vs_raw_read']:.2f}x raw read {raw['raw_read_gbps']:.2f}"
            f" (target >= 0.9x); put {disk['put_gbps']:.2f} GB/s = {disk['put_vs_raw_write']:.2f}x raw write"
            f" {raw['raw_write_gbps']:.2f} (target >= 0.8x) [{raw['raw_tool']}]")
        log(f"  disk   get p50/p99 {disk['get']['p50_ms']}/{disk['get']['p99_ms']} ms, put p50/p99 "
            f"{disk['put']['p50_ms']}/{disk['put']['p99_ms']} ms; buffered (page cache) get {buffered['get_gbps']:.2f}"
            f" put {buffered['put_gbps']:.2f} GB/s")
    lk = bench_lookup(path)
    log(f"lookup 128 chunks: disk {lk['lookup_disk_ms_128_chunks']} ms, memory {lk['lookup_memory_ms_128_chunks']} ms"
        f" (target <= 1 ms); key hashing 32K tokens: {lk['keys_ms_32k_tokens_numpy']} ms (numpy), "
        f"{lk['keys_ms_32k_tokens_list']} ms (list)")
    rec = bench_recovery(path, 10_000 if quick else 100_000)
    result["index_recovery"] = rec
    log(f"index recovery of {rec['chunks']} chunks: {rec['open_s_no_manifest']} s reading every header, "
        f"{rec['open_s_with_manifest']} s with the manifest")
    d = result["models"]["default"]
    result.update({"memory": d["memory"], "disk": d["disk"], **lk})
    return result


def to_markdown(r: dict) -> str:
    """A human report of one run (machine, command, figures vs raw baselines and targets)."""
    m = r["machine"]
    lines = [f"# kvtier store benchmark ({time.strftime('%Y-%m-%d', time.gmtime(r.get('time', time.time())))})", "",
             f"Command: `{r.get('command', 'kvtier bench store')}`", "",
             f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_kib'] / 2**20:.1f} GiB RAM, kernel {m['kernel']},"
             f" Python {m['python']}; disk under test ({m['fs_type']}):", "", "```", m["df"], "```", "",
             f"Volume per model per disk pass: {r['volume_bytes'] / 2**20:.0f} MiB; disk files dropped from the page "
             "cache (fsync + POSIX_FADV_DONTNEED) before every read pass. Raw baselines measured in the same run: "
             "memcpy between pre-faulted buffers; sequential O_DIRECT write/read of the same volume in chunk-sized "
             f"blocks ({r['disk']['raw_tool']}).", "",
             "| model | chunk | tier | get GB/s | baseline GB/s | ratio (target) | put GB/s | baseline GB/s | ratio (target) "
             "| get p50/p99 ms | put p50/p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, d in r["models"].items():
        mb = f"{d['chunk_bytes'] / 2**20:.2f} MiB"
        me, di, bu = d["memory"], d["disk"], d["disk_buffered"]
        lines.append(f"| {name} | {mb} | memory | {me['get_gbps']} | memcpy {me['memcpy_gbps']} | "
                     f"{me['get_vs_memcpy']} (≥0.5) | {me['put_gbps']} | memcpy {me['memcpy_put_gbps']} | "
                     f"{me['put_gbps'] / me['memcpy_put_gbps']:.3f} | {me['get']['p50_ms']}/{me['get']['p99_ms']} | "
                     f"{me['put']['p50_ms']}/{me['put']['p99_ms']} |")
        lines.append(f"| {name} | {mb} | disk (O_DIRECT) | {di['get_gbps']} | raw read {di['raw_read_gbps']} | "
                     f"{di['get_vs_raw_read']} (≥0.9) | {di['put_gbps']} | raw write {di['raw_write_gbps']} | "
                     f"{di['put_vs_raw_write']} (≥0.8) | {di['get']['p50_ms']}/{di['get']['p99_ms']} | "
                     f"{di['put']['p50_ms']}/{di['put']['p99_ms']} |")
        lines.append(f"| {name} | {mb} | disk (buffered) | {bu['get_gbps']} | raw read {di['raw_read_gbps']} | "
                     f"{bu['get_gbps'] / di['raw_read_gbps']:.3f} | {bu['put_gbps']} | raw write {di['raw_write_gbps']} | "
                     f"{bu['put_gbps'] / di['raw_write_gbps']:.3f} | {bu['get']['p50_ms']}/{bu['get']['p99_ms']} | "
                     f"{bu['put']['p50_ms']}/{bu['put']['p99_ms']} |")
    rec = r.get("index_recovery", {})
    lines += ["", f"Memory first fill (slab allocation + page faults, once per process): "
              f"{r['models']['default']['memory']['first_fill_gbps']} GB/s (default model).", "",
              f"Lookup of a 32K-token prompt (128 chunks): {r['lookup_disk_ms_128_chunks']} ms median with every chunk "
              f"on disk (one stat each; p99 {r['lookup_disk_p99_ms']} ms), {r['lookup_memory_ms_128_chunks']} ms in RAM "
              f"(target ≤ 1 ms). Key hashing for those 32K tokens, separately: {r['keys_ms_32k_tokens_numpy']} ms from a "
              f"numpy array, {r['keys_ms_32k_tokens_list']} ms from a Python list.", "",
              f"Index recovery at open for {rec.get('chunks')} chunk files: {rec.get('open_s_no_manifest')} s reading every "
              f"header, {rec.get('open_s_with_manifest')} s with the manifest.", ""]
    return "\n".join(lines)
