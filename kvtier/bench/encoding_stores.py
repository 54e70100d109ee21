"""Store figures of ``kvtier bench encoding``: real KV chunks stored in, and read back from, real shared
backends in every encoding, in the same run.

Payloads: real chunks of each captured dtype (``shared_seed.chunk_files`` of a writer engine's SSD
directory, verified), up to ``volume`` plain bytes per dtype, with their real shapes and namespace; each
round stores them under fresh keys (nothing read was cached by an earlier round). Per round, backend and
dtype, every encoding in turn (the order rotates from round to round, so a slow moment of the machine
does not always hit the same encoding):

* **put**: ``threads`` callers each ``write`` one chunk at a time through the tier a store opens for the
  encoding (``registry.open_shared_backend``: ``EncodedTier`` over the backend for zstd / int8, encoding
  on the calling thread), then ``flush``: plain MB per second of that wall time;
* **bytes stored**, measured on the backend after the flush: sharedfs the sizes of the chunk files,
  valkey ``STRLEN`` of every value (header + frame + trailer: what the backend holds for the chunk);
* **get**: the same chunks read back through the stack a store reads a shared tier with (``GuardedTier``
  over that tier, opened on the *reading* config: for a filesystem the second mount), ``threads`` callers
  with one chunk per call into lent buffers, as the connector's asynchronous loads read: plain KV MB
  delivered per second (decoded, verified) and chunks per second.

Figures are medians over rounds; ratios against plain are medians of per-round ratios (same round,
same chunks). Lossless reads are checked byte-exact against the originals after each timed pass (not
timed); every chunk must be stored and read back, or the run fails.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvtier.bench.shared_seed import SharedTarget, shared_config
from kvtier.bench.store_bench_sharedfs import _threads, _wait_visible

MB = 1e6
THREADS = 2                    # the connector's asynchronous loads keep 2 chunk reads in flight


@dataclass
class Payloads:
    """Real chunks of one dtype: their namespace, metas and payload bytes."""

    dtype: str
    namespace: Any
    metas: list
    payloads: list[bytes]

    @property
    def plain_bytes(self) -> int:
        return sum(len(p) for p in self.payloads)

    @property
    def tokens(self) -> int:
        return sum(m.num_tokens for m in self.metas)


@dataclass
class StoreCell:
    """One (backend, dtype, encoding): per-round figures."""

    backend: str
    dtype: str
    encoding: str
    put_mbps: list[float] = field(default_factory=list)
    get_mbps: list[float] = field(default_factory=list)
    get_chunks_per_s: list[float] = field(default_factory=list)
    stored_bytes: list[int] = field(default_factory=list)
    chunks: int = 0
    tokens: int = 0
    plain_bytes: int = 0

    def to_json(self, plain: "StoreCell | None") -> dict:
        med = lambda xs: round(statistics.median(xs), 3) if xs else None   # noqa: E731
        d: dict[str, Any] = {"backend": self.backend, "dtype": self.dtype, "encoding": self.encoding,
                             "chunks": self.chunks, "tokens": self.tokens, "plain_bytes": self.plain_bytes,
                             "rounds": len(self.get_mbps), "put_mbps": med(self.put_mbps),
                             "get_mbps": med(self.get_mbps), "get_chunks_per_s": med(self.get_chunks_per_s),
                             "stored_bytes_per_token": round(statistics.median(self.stored_bytes) / self.tokens, 1)
                             if self.stored_bytes and self.tokens else None,
                             "per_round": {"put_mbps": [round(x, 3) for x in self.put_mbps],
                                           "get_mbps": [round(x, 3) for x in self.get_mbps],
                                           "stored_bytes": self.stored_bytes}}
        if plain is not None and plain.get_mbps and self.get_mbps:
            d["get_vs_plain"] = round(statistics.median(a / b for a, b in zip(self.get_mbps, plain.get_mbps)), 3)
            d["put_vs_plain"] = round(statistics.median(a / b for a, b in zip(self.put_mbps, plain.put_mbps)), 3)
            d["stored_vs_plain"] = round(statistics.median(a / b for a, b in zip(self.stored_bytes,
                                                                                 plain.stored_bytes)), 4)
        return d


def load_payloads(disk_dir: Path, volume: int) -> Payloads:
    """Up to ``volume`` plain bytes of the verified chunks under one writer's SSD directory (in file-name
    order: keys are hashes, so a sample spread over the prompts)."""
    from kvtier.bench.shared_seed import chunk_files, read_chunk_file

    for ns, files in chunk_files(disk_dir):
        out = Payloads(ns.dtype, ns, [], [])
        for f in files:
            meta, payload = read_chunk_file(ns, f)
            if out.payloads and out.plain_bytes + len(payload) > volume:
                break
            out.metas.append(meta)
            out.payloads.append(bytes(payload))
        return out
    raise RuntimeError(f"no chunks under {disk_dir}")


def rotate(xs: tuple[str, ...], r: int) -> tuple[str, ...]:
    """``xs`` started at its ``r``-th element (the order of round ``r``)."""
    k = r % len(xs)
    return xs[k:] + xs[:k]


def _fresh(metas: list, tag: str) -> list:
    from dataclasses import replace

    return [replace(m, key=hashlib.blake2b(m.key + tag.encode(), digest_size=32).digest(), parent=None) for m in metas]


class _Backend:
    """One backend's configs for a round: the writer's and the reader's ``store.shared`` dicts."""

    def __init__(self, target: SharedTarget, run: str) -> None:
        self.target, self.run = target, run

    def configs(self, encoding: str, r: int, dtype: str) -> tuple[dict, dict]:
        tag = f"{self.run}-{dtype}-{r}"
        if self.target.kind == "sharedfs":
            w = {**self.target.write, "path": str(Path(self.target.write["path"]) / tag), "create": True}
            rd = {**self.target.read, "path": str(Path(self.target.read["path"]) / tag)}
        else:
            w = {**self.target.write, "key_prefix": f"kvtier-benc-{tag}-{encoding}"}
            rd = {**self.target.read, "key_prefix": w["key_prefix"]}
        base = {"janitor": False} if self.target.kind == "sharedfs" else {}
        deadlines = {"io_timeout_s": 120.0, "lookup_timeout_s": 60.0, "max_inflight": THREADS}
        return ({**base, **w, **deadlines, "encoding": encoding}, {**base, **rd, **deadlines, "encoding": encoding})

    def stored_bytes(self, cfg: Any, ns: Any) -> int:
        if self.target.kind == "sharedfs":
            root = Path(cfg.path) / ns.short_id() / "chunks"
            return sum(p.stat().st_size for p in root.rglob("*.kvc"))
        import valkey

        pw = cfg.password.get_secret_value() if cfg.password else None
        c = valkey.Valkey.from_url(cfg.url, password=pw, socket_timeout=60)
        try:
            names = list(c.scan_iter(match=f"{cfg.key_prefix}:*", count=1000))
            p = c.pipeline(transaction=False)
            for n in names:
                p.strlen(n)
            return int(sum(p.execute()))
        finally:
            c.close()

    def cleanup(self, dtype: str, r: int) -> None:
        if self.target.kind == "sharedfs":
            shutil.rmtree(Path(self.target.write["path"]) / f"{self.run}-{dtype}-{r}", ignore_errors=True)


def _pass(backend: _Backend, pl: Payloads, encoding: str, r: int, cell: StoreCell) -> tuple[dict, list]:
    """Put every chunk in ``encoding``, measure what the backend holds; returns (read config, keys)."""
    from kvtier.metrics import Telemetry
    from kvtier.tiers.encoded import encoded_namespace
    from kvtier.tiers.protocol import WriteItem
    from kvtier.tiers.registry import open_shared_backend

    wcfg, rcfg = backend.configs(encoding, r, pl.dtype)
    metas = _fresh(pl.metas, f"{backend.run}-{r}")
    tier = open_shared_backend(shared_config(wcfg), pl.namespace, Telemetry())
    try:
        refused: list[int] = []

        def put(i: int) -> None:
            if not tier.write([WriteItem(metas[i], memoryview(pl.payloads[i]))])[0]:
                refused.append(i)
        t0 = time.perf_counter()
        _threads(len(metas), THREADS, put)
        if not tier.flush(300):
            raise RuntimeError(f"{backend.target.kind} {encoding}: writes not flushed in 300 s")
        wall = time.perf_counter() - t0
    finally:
        tier.close()
    if refused:
        raise RuntimeError(f"{backend.target.kind} {encoding}: {len(refused)} of {len(metas)} puts refused")
    cell.put_mbps.append(pl.plain_bytes / MB / wall)
    wc = shared_config(wcfg)
    cell.stored_bytes.append(backend.stored_bytes(wc, encoded_namespace(pl.namespace, encoding)))
    return rcfg, metas


def _get(backend: _Backend, pl: Payloads, encoding: str, rcfg: dict, metas: list, cell: StoreCell) -> None:
    from kvtier.metrics import Telemetry
    from kvtier.tiers.protocol import Deadline
    from kvtier.tiers.registry import guard_if_shared, open_shared_backend

    cfg = shared_config(rcfg)
    if backend.target.kind == "sharedfs":           # the reading mount may show new files up to ~1 s later
        from kvtier.tiers.encoded import encoded_namespace
        from kvtier.tiers.sharedfs.layout import Layout

        ns = encoded_namespace(pl.namespace, encoding)
        _wait_visible(Path(Layout(Path(cfg.path), ns, cfg.dir_levels).path_of(metas[-1].key)))
    tm = Telemetry()
    tier = guard_if_shared(open_shared_backend(cfg, pl.namespace, tm), cfg, tm)
    outs = [memoryview(bytearray(len(p))) for p in pl.payloads]
    try:
        misses: list[str] = []

        def get(i: int) -> None:
            res = tier.read_into([metas[i].key], [outs[i]], Deadline.after(120), lent=True)[0]
            if not res.ok:
                misses.append(f"chunk {i}: {res.status.name} {res.error}")
        t0 = time.perf_counter()
        _threads(len(metas), THREADS, get)
        wall = time.perf_counter() - t0
    finally:
        tier.close()
    if misses:
        raise RuntimeError(f"{backend.target.kind} {encoding}: {len(misses)} reads missed, first: {misses[0]}")
    cell.get_mbps.append(pl.plain_bytes / MB / wall)
    cell.get_chunks_per_s.append(len(metas) / wall)
    if encoding != "int8":
        bad = [i for i, (o, p) in enumerate(zip(outs, pl.payloads)) if bytes(o) != p]
        if bad:
            raise RuntimeError(f"{backend.target.kind} {encoding}: {len(bad)} chunks read back different")


def measure_stores(targets: list[SharedTarget], payloads: list[Payloads], encodings: tuple[str, ...],
                   repeats: int, log: Callable[[str], None] = print) -> list[dict]:
    """Every (backend, dtype, encoding) as JSON rows (see the module doc)."""
    run = uuid.uuid4().hex[:8]
    cells: dict[tuple[str, str, str], StoreCell] = {}
    for r in range(repeats):
        order = rotate(encodings, r)
        for t in targets:
            be = _Backend(t, run)
            for pl in payloads:
                read_side = {}
                try:
                    for e in order:
                        cell = cells.setdefault((t.kind, pl.dtype, e), StoreCell(t.kind, pl.dtype, e, chunks=len(
                            pl.metas), tokens=pl.tokens, plain_bytes=pl.plain_bytes))
                        read_side[e] = _pass(be, pl, e, r, cell)
                    for e in order:
                        _get(be, pl, e, *read_side[e], cells[(t.kind, pl.dtype, e)])
                finally:
                    _delete(be, pl, r, read_side)
                log(f"[stores] round {r + 1}/{repeats} {t.kind} {pl.dtype}: " + ", ".join(
                    f"{e} get {cells[(t.kind, pl.dtype, e)].get_mbps[-1]:.0f} MB/s" for e in order))
    return [c.to_json(cells.get((c.backend, c.dtype, "plain"))) for c in cells.values()]


def _delete(be: _Backend, pl: Payloads, r: int, read_side: dict) -> None:
    """Remove a round's chunks (valkey: through the tier; sharedfs: the round's directory)."""
    if be.target.kind == "sharedfs":
        be.cleanup(pl.dtype, r)
        return
    from kvtier.metrics import Telemetry
    from kvtier.tiers.registry import open_shared_backend

    for e, (rcfg, metas) in read_side.items():
        tier = open_shared_backend(shared_config(rcfg), pl.namespace, Telemetry())
        try:
            tier.delete_many([m.key for m in metas])
        finally:
            tier.close()
