"""``kvtier bench store --shared valkey,mooncake``: the shared tiers against their own clients.

For each backend, in the same run and at the same concurrency (``threads`` callers, batches of
``batch`` chunks of the default model's chunk size):

* tier put: ``Tier.write`` (encode header + checksum + one value / scatter put) vs **raw put**: the
  backend's client storing the same number of bytes per key (valkey: a pipeline of ``SET``;
  mooncake: ``batch_put_from`` of pre-built blobs), no kvtier code in the loop;
* tier get: ``Tier.read_into`` (verified, into caller buffers) vs **raw get** (valkey: pipelined
  ``GET`` returning bytes; mooncake: ``batch_get_into`` of the whole blob into a buffer);
* existence checks for a 256-chunk prompt (``longest_prefix``, all present): keys checked per second.

Per-chunk latency is the batch call's time divided by its chunks (p50/p99 over all calls). Every
figure is the median of ``repeat`` rounds; in each round raw and tier passes alternate order; keys
are deleted before every put pass (a Mooncake put of an existing key would not move the bytes).
Servers: ``--valkey URL`` / ``--mooncake MASTER,METADATA_URL``, else throwaway local ones started
with the repository's test-service harness (tests/services) on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kvtier.chunk import ChunkMeta, file_size
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, WriteItem

GB = 1e9
PROMPT_CHUNKS = 256


def _ns(chunk: int) -> Namespace:
    return Namespace("bench-shared", f"chunk{chunk}", "bfloat16", "bench", 16, 256)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else 0.0


def _parallel(threads: int, batches: list[list[int]], call: Callable[[list[int]], None]) -> tuple[float, list[float]]:
    """Run ``call`` over ``batches`` from ``threads`` threads; wall seconds and per-chunk latencies."""
    lat: list[float] = []
    lock = threading.Lock()
    todo = list(batches)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                b = todo.pop()
            t0 = time.perf_counter()
            call(b)
            dt = (time.perf_counter() - t0) / len(b)
            with lock:
                lat.extend([dt] * len(b))

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, lat


@contextlib.contextmanager
def _local(backend: str, volume: int) -> Iterator[dict]:
    """Start a throwaway server with the test-service harness (a repository checkout)."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from tests.services.mooncake import MooncakeCluster
        from kvtier.services.valkey_server import ValkeyServer
    except ImportError as exc:
        raise SystemExit(f"error: no --{backend} endpoint given and the test-service harness is not importable "
                         f"({exc})") from None
    with tempfile.TemporaryDirectory(prefix=f"kvtier-bench-{backend}-") as tmp:
        if backend == "valkey":
            srv = ValkeyServer.start(Path(tmp), maxmemory="4gb", policy="allkeys-lru")
            try:
                yield {"url": srv.url}
            finally:
                srv.stop()
        else:
            mc = MooncakeCluster.start(Path(tmp), segment_bytes=3 * volume + 256 * 2**20)
            try:
                yield {"master": mc.master_addr, "metadata": mc.metadata_url}
            finally:
                mc.stop()


class _Backend:
    """The tier plus the same backend's raw client, on the same server."""

    def __init__(self, kind: str, ep: dict, chunk: int, threads: int) -> None:
        self.kind, self.chunk = kind, chunk
        ns = _ns(chunk)
        if kind == "valkey":
            import valkey

            from kvtier.config import ValkeyConfig
            from kvtier.tiers.valkey import ValkeyTier
            cfg = ValkeyConfig(url=ep["url"], io_timeout_s=60, lookup_timeout_s=10, max_inflight=threads)
            self.tier = ValkeyTier.open(cfg, ns, Telemetry())
            pw = cfg.password.get_secret_value() if cfg.password else None
            self.raw = valkey.Valkey.from_url(cfg.url, password=pw, socket_timeout=60,
                                              max_connections=threads * 2)
        else:
            from kvtier.config import MooncakeConfig
            from kvtier.tiers.mooncake import MooncakeTier
            cfg = MooncakeConfig(master=ep["master"], metadata_server=ep["metadata"], io_timeout_s=60,
                                 lookup_timeout_s=10, max_inflight=threads)
            self.tier = MooncakeTier.open(cfg, ns, Telemetry())
            if self.tier._client.store is None:
                raise SystemExit(f"error: mooncake master {ep['master']} not reachable")
            self.raw = self.tier._client.store  # the same client: raw calls bypass kvtier's code only
        try:  # the path the store takes: the tier behind GuardedTier (bounded pool, deadlines)
            from kvtier.tiers.guard import GuardedTier
            self.guarded = GuardedTier.wrap(self.tier, cfg, Telemetry())
        except ImportError:
            self.guarded = None

    def raw_put(self, names: list[str], blobs: list[np.ndarray]) -> None:
        if self.kind == "valkey":
            p = self.raw.pipeline(transaction=False)
            for n, b in zip(names, blobs):
                p.set(n, memoryview(b))
            p.execute()
        else:
            rc = self.raw.batch_put_from(names, [int(b.ctypes.data) for b in blobs], [b.nbytes for b in blobs])
            assert all(r == 0 for r in rc), rc

    def raw_put_packed(self, names: list[str], blobs: list[np.ndarray]) -> None:
        """valkey only: the same SETs hand-packed, blob sent as is (the socket ceiling: valkey-py with
        its libvalkey packer copies each value into one command buffer first)."""
        from kvtier.tiers.valkey.wire import send_sets

        cmds = [[b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(n), n.encode(), b.nbytes), memoryview(b),
                 b"\r\n"] for n, b in zip(names, blobs)]
        assert all(r == b"OK" for r in send_sets(self.raw, cmds))

    def raw_get(self, names: list[str], outs: list[np.ndarray]) -> None:
        if self.kind == "valkey":
            p = self.raw.pipeline(transaction=False)
            for n in names:
                p.get(n)
            assert all(v is not None for v in p.execute())
        else:
            rc = self.raw.batch_get_into(names, [int(o.ctypes.data) for o in outs], [o.nbytes for o in outs])
            assert all(r > 0 for r in rc), rc

    def raw_delete(self, names: list[str]) -> None:
        if self.kind == "valkey":
            self.raw.delete(*names)
        else:
            for n in names:
                self.raw.remove(n, True)


def bench_backend(kind: str, ep: dict, chunk: int, n: int, threads: int, batch: int, repeat: int,
                  log=print) -> dict:
    be = _Backend(kind, ep, chunk, threads)
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(n)]
    keys = [ChunkKey(bytes(rng.integers(0, 256, 32, dtype=np.uint8))) for _ in range(n)]
    metas = [ChunkMeta(k, None, 256, (chunk // 2,), "bfloat16", chunk) for k in keys]
    blobs = [np.concatenate([np.zeros(file_size(chunk) - chunk, np.uint8), p]) for p in payloads]
    raw_names = [f"kvtier-bench-raw:{i}" for i in range(n)]
    outs = [np.zeros(chunk, np.uint8) for _ in range(n)]
    raw_outs = [np.zeros(file_size(chunk), np.uint8) for _ in range(n)]
    batches = [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]
    total = n * file_size(chunk)
    names = ["get", "put", "raw_get", "raw_put"] + (["guarded_get", "guarded_put"] if be.guarded else []) + \
        (["raw_put_packed"] if kind == "valkey" else [])
    fig: dict[str, list[float]] = {f"{k}_gbps": [] for k in names}
    lat: dict[str, list[float]] = {k: [] for k in names}

    def tier_put(b: list[int]) -> None:
        ok = be.tier.write([WriteItem(metas[i], memoryview(payloads[i])) for i in b])
        assert all(ok), f"{kind} tier put failed"

    def tier_get(b: list[int]) -> None:
        res = be.tier.read_into([keys[i] for i in b], [memoryview(outs[i]) for i in b], Deadline.after(120))
        assert all(r.ok for r in res), f"{kind} tier get missed: {[r.error for r in res if not r.ok][:3]}"

    def guarded_put(b: list[int]) -> None:
        assert all(be.guarded.write([WriteItem(metas[i], memoryview(payloads[i])) for i in b]))
        assert be.guarded.flush(120)

    def guarded_get(b: list[int]) -> None:
        res = be.guarded.read_into([keys[i] for i in b], [memoryview(outs[i]) for i in b], Deadline.after(120))
        assert all(r.ok for r in res), f"{kind} guarded get missed: {[r.error for r in res if not r.ok][:3]}"

    passes = {
        "put": (lambda: be.tier.delete_many(keys), tier_put),
        "raw_put": (lambda: be.raw_delete(raw_names), lambda b: be.raw_put([raw_names[i] for i in b],
                                                                           [blobs[i] for i in b])),
        "get": (None, tier_get),
        "raw_get": (None, lambda b: be.raw_get([raw_names[i] for i in b], [raw_outs[i] for i in b])),
        "guarded_put": (lambda: be.tier.delete_many(keys), guarded_put),
        "raw_put_packed": (lambda: be.raw_delete(raw_names), lambda b: be.raw_put_packed([raw_names[i] for i in b],
                                                                                         [blobs[i] for i in b])),
        "guarded_get": (None, guarded_get),
    }
    groups = [("put", "raw_put") + (("raw_put_packed",) if kind == "valkey" else ()), ("get", "raw_get")] + \
        ([("guarded_put",), ("guarded_get",)] if be.guarded else [])
    for r in range(repeat):
        for pair in groups:
            for name in (pair if r % 2 == 0 else pair[::-1]):
                prep, call = passes[name]
                if prep:
                    prep()
                wall, l = _parallel(threads, batches, call)
                fig[f"{name}_gbps"].append(total / wall / GB)
                lat[name].extend(l)
    for i, (o, p) in enumerate(zip(outs, payloads)):
        assert np.array_equal(o, p), f"{kind}: chunk {i} read back wrong"
    out: dict = {k: round(statistics.median(v), 3) for k, v in fig.items()}
    out["per_round"] = {k: [round(x, 3) for x in v] for k, v in fig.items()}
    out["get_vs_raw"] = round(statistics.median([a / b for a, b in zip(fig["get_gbps"], fig["raw_get_gbps"])]), 3)
    out["put_vs_raw"] = round(statistics.median([a / b for a, b in zip(fig["put_gbps"], fig["raw_put_gbps"])]), 3)
    if kind == "valkey":
        out["put_vs_raw_packed"] = round(statistics.median(
            [a / b for a, b in zip(fig["put_gbps"], fig["raw_put_packed_gbps"])]), 3)
    if be.guarded:
        for op in ("get", "put"):
            out[f"guarded_{op}_vs_raw"] = round(statistics.median(
                [a / b for a, b in zip(fig[f"guarded_{op}_gbps"], fig[f"raw_{op}_gbps"])]), 3)
    for k, v in lat.items():
        out[f"{k}_p50_ms"] = round(_pct(v, 0.5) * 1e3, 3)
        out[f"{k}_p99_ms"] = round(_pct(v, 0.99) * 1e3, 3)
    out.update(exists=_bench_exists(be, kind), chunk_bytes=chunk, chunks=n, threads=threads, batch=batch,
               repeat=repeat)
    be.tier.delete_many(keys)
    be.raw_delete(raw_names)
    (be.guarded or be.tier).close()
    return out


def _bench_exists(be: _Backend, kind: str, reps: int = 50) -> dict:
    """``longest_prefix`` of a 256-chunk prompt whose chunks are all present (small payloads)."""
    rng = np.random.default_rng(1)
    keys = [ChunkKey(bytes(rng.integers(0, 256, 32, dtype=np.uint8))) for _ in range(PROMPT_CHUNKS)]
    small = np.zeros(4096, np.uint8)
    items = [WriteItem(ChunkMeta(k, None, 256, (2048,), "bfloat16", 4096), memoryview(small)) for k in keys]
    assert all(be.tier.write(items)), f"{kind}: could not store the lookup prompt"
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        p = be.tier.longest_prefix(keys, Deadline.after(60))
        times.append(time.perf_counter() - t0)
        assert p.num_chunks == PROMPT_CHUNKS, p
    be.tier.delete_many(keys)
    med = statistics.median(times)
    return {"lookup_ms_256_chunks": round(med * 1e3, 3), "p99_ms": round(_pct(times, 0.99) * 1e3, 3),
            "checks_per_s": round(PROMPT_CHUNKS / med)}


def run_shared(backends: list[str], chunk: int, volume: int, repeat: int, threads: int = 2, batch: int = 8,
               endpoints: dict[str, dict] | None = None, log=print) -> dict:
    """Rows for each backend plus the flat ``<backend>.<figure>`` keys of the JSON report."""
    result: dict = {}
    n = max(batch, volume // file_size(chunk))
    for kind in backends:
        if kind not in ("valkey", "mooncake"):
            raise SystemExit(f"error: --shared: unknown backend {kind!r} (valkey, mooncake)")
        log(f"[{kind}] {n} chunks of {chunk / 2**20:.2f} MiB, {threads} threads x batches of {batch}, {repeat} rounds")
        ep = (endpoints or {}).get(kind)
        with (contextlib.nullcontext(ep) if ep else _local(kind, volume)) as e:
            d = bench_backend(kind, e, chunk, n, threads, batch, repeat, log=log)
        result[kind] = d
        for k in ("get_gbps", "put_gbps", "raw_get_gbps", "raw_put_gbps"):
            result[f"{kind}.{k}"] = d[k]
        result[f"{kind}.exists_per_s_256_chunks"] = d["exists"]["checks_per_s"]
        if "raw_put_packed_gbps" in d:
            result[f"{kind}.raw_put_packed_gbps"] = d["raw_put_packed_gbps"]
            log(f"  put vs the hand-packed SET socket ceiling {d['raw_put_packed_gbps']} GB/s: {d['put_vs_raw_packed']}x")
        log(f"  get {d['get_gbps']} GB/s = {d['get_vs_raw']}x raw {d['raw_get_gbps']} (target >= 0.8x); put "
            f"{d['put_gbps']} GB/s = {d['put_vs_raw']}x raw {d['raw_put_gbps']}; get p50/p99 {d['get_p50_ms']}/"
            f"{d['get_p99_ms']} ms per chunk; 256-chunk lookup {d['exists']['lookup_ms_256_chunks']} ms "
            f"({d['exists']['checks_per_s']} checks/s)")
        if "guarded_get_gbps" in d:
            result[f"{kind}.guarded_get_gbps"] = d["guarded_get_gbps"]
            result[f"{kind}.guarded_put_gbps"] = d["guarded_put_gbps"]
            log(f"  through GuardedTier (the store's path): get {d['guarded_get_gbps']} GB/s = "
                f"{d['guarded_get_vs_raw']}x raw, put (write + flush) {d['guarded_put_gbps']} GB/s = "
                f"{d['guarded_put_vs_raw']}x raw")
    return result


def shared_markdown(r: dict) -> list[str]:
    """Report lines for the shared backends of a run (empty when none ran)."""
    rows = [(k, v) for k, v in r.get("shared", {}).items() if isinstance(v, dict)]
    if not rows:
        return []
    lines = ["", "Shared tiers vs the same backend's own client (same bytes, same concurrency, same run; per-chunk "
             "latency = batch time / chunks):", "",
             "| backend | chunk | threads x batch | get GB/s | raw get GB/s | get ratio (≥0.8) | put GB/s | raw put GB/s "
             "| put ratio (≥0.8) | get p50/p99 ms | put p50/p99 ms | raw get p50/p99 ms | 256-chunk lookup ms "
             "| checks/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, d in rows:
        lines.append(f"| {k} | {d['chunk_bytes'] / 2**20:.2f} MiB | {d['threads']} x {d['batch']} | {d['get_gbps']} | "
                     f"{d['raw_get_gbps']} | **{d['get_vs_raw']}** | {d['put_gbps']} | {d['raw_put_gbps']} | "
                     f"**{d['put_vs_raw']}** | {d['get_p50_ms']}/{d['get_p99_ms']} | {d['put_p50_ms']}/"
                     f"{d['put_p99_ms']} | {d['raw_get_p50_ms']}/{d['raw_get_p99_ms']} | "
                     f"{d['exists']['lookup_ms_256_chunks']} | {d['exists']['checks_per_s']} |")
    for k, d in rows:
        if "raw_put_packed_gbps" in d:
            lines += ["", f"{k}: put vs the same SETs hand-packed (blob sent as is, no client packing: the socket "
                      f"ceiling) {d['raw_put_packed_gbps']} GB/s: **{d['put_vs_raw_packed']}x** (valkey-py's own "
                      "pipeline, the `raw put` column, copies each value into one command buffer first)."]
    guarded = [(k, d) for k, d in rows if "guarded_get_gbps" in d]
    if guarded:
        lines += ["", "Through `GuardedTier` (the path the store takes: bounded pool, deadline, private read "
                  "buffers copied into the caller's on success; put = write + flush):", "",
                  "| backend | get GB/s | get vs raw | put GB/s | put vs raw |", "|---|---|---|---|---|"]
        for k, d in guarded:
            lines.append(f"| {k} | {d['guarded_get_gbps']} | {d['guarded_get_vs_raw']} | {d['guarded_put_gbps']} | "
                         f"{d['guarded_put_vs_raw']} |")
    return lines
