"""Put "machine A's" chunks into a shared backend for the benchmarks' shared-tier hits.

The TTFT bench and the long-document demo measure a hit from a shared tier in a fresh engine
whose own RAM and SSD are empty. The chunks it reads must already be in the backend. Instead
of one more cold prefill per backend (60-90 s at 8K tokens on a 2-core CPU), the chunk files a
writer engine left in its SSD directory are copied into the backend through the backend
tier's own ``put`` (the same encoded format, keys and parent links a store writes, in the
config's ``encoding`` through the same ``EncodedTier`` a store opens; only who calls ``put``
differs). ``seed_shared`` verifies every file first (a torn or foreign file is
skipped and counted), writes parents before children, and reads the chain back with one
``longest_prefix`` per namespace so a seeded row cannot silently miss.

``SharedTarget`` is one backend as the benchmarks see it: the config "machine A" writes with
and the config "machine B" (the fresh engine) reads with, e.g. the same JuiceFS directory
through two mounts, plus files to evict from the page cache before each timed hit.

Side effects: ``seed_shared`` writes into the backend; ``chunk_files`` / ``read_chunk_file`` (a disk
tier directory's verified chunks, also what ``bench encoding`` measures its codecs on) only read.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pydantic import TypeAdapter, ValidationError

from kvtier.config import ConfigError, SharedTierConfig

_ADAPTER: TypeAdapter = TypeAdapter(SharedTierConfig)


def shared_config(data: dict[str, Any]) -> Any:
    """A validated ``store.shared`` config (one-line ``ConfigError`` naming the problem)."""
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise ConfigError(f"shared tier config: {where}: {first.get('msg')}") from None


#: deadlines of the benchmarks' shared-tier readers: on a busy 2-core VM the production defaults
#: (lookup 0.5 s, I/O 5 s) can turn a hit into a counted miss, and the hit rows then fail their check
BENCH_DEADLINES = {"lookup_timeout_s": 10.0, "io_timeout_s": 60.0}


def reader_config(read: dict[str, Any]) -> dict[str, Any]:
    """``read`` with the benchmarks' deadlines (unless it sets its own) and, for sharedfs, no
    janitor (a reader must not evict what it is about to measure)."""
    cfg = {**BENCH_DEADLINES, **read}
    if cfg.get("kind") == "sharedfs":
        cfg.setdefault("janitor", False)
    return cfg


@dataclass(frozen=True)
class SharedTarget:
    """One shared backend in a benchmark: ``write`` / ``read`` are ``store.shared`` configs (dicts
    that ``shared_config`` accepts) of the writing and of the reading machine; ``evict``: files or
    directories whose page cache is dropped before each timed read (e.g. JuiceFS's data dir)."""

    kind: str
    write: dict[str, Any]
    read: dict[str, Any]
    evict: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for cfg in (self.write, self.read):
            if shared_config(cfg).kind != self.kind:
                raise ConfigError(f"shared target {self.kind}: config kind {cfg.get('kind')!r} differs")

    def to_json(self) -> dict[str, Any]:
        """JSON-safe (passwords stay in the configs: never print this)."""
        return {"kind": self.kind, "write": self.write, "read": self.read, "evict": list(self.evict)}


@dataclass
class SeedResult:
    chunks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    refused: int = 0                  # put returned False
    skipped: list[str] = field(default_factory=list)   # files that did not verify
    readable: int = 0                 # chunks longest_prefix found afterwards (per chain, summed)

    @property
    def ok(self) -> bool:
        return self.refused == 0 and self.readable == self.chunks


def _chain_order(metas: dict[bytes, Any]) -> list[bytes]:
    """Keys with every parent before its children (parents outside ``metas`` are roots)."""
    depth: dict[bytes, int] = {}

    def d(k: bytes) -> int:
        seen = []
        while k not in depth:
            p = metas[k].parent
            if p is None or p not in metas:
                depth[k] = 0
                break
            seen.append(k)
            k = p
        for s in reversed(seen):
            depth[s] = depth[metas[s].parent] + 1
        return depth[seen[0]] if seen else depth[k]

    return sorted(metas, key=lambda k: (d(k), k))


def _leaves_chains(metas: dict[bytes, Any]) -> list[list[bytes]]:
    """Every root-to-leaf chain (for the read-back check)."""
    parents = {m.parent for m in metas.values() if m.parent is not None}
    chains = []
    for k in metas:
        if k in parents:
            continue
        chain = [k]
        while metas[chain[-1]].parent in metas:
            chain.append(metas[chain[-1]].parent)
        chains.append(chain[::-1])
    return chains


def chunk_files(disk_path: Path) -> Iterator[tuple[Any, list[Path]]]:
    """Per namespace under the disk tier directory ``disk_path``: its ``Namespace`` (checked against
    the recorded digest) and its chunk files, in name order."""
    from kvtier.keys import Namespace
    from kvtier.tiers.disklayout import SUFFIX, NamespaceDir

    for nsd in NamespaceDir.all_under(Path(disk_path)):
        info = json.loads(nsd.namespace_json.read_text())
        ns = Namespace(**info["namespace"])
        if ns.digest().hex() != info["digest"]:
            raise ConfigError(f"{nsd.namespace_json}: namespace fields do not give the recorded digest")
        yield ns, [f for sub in sorted(nsd.chunks.iterdir()) for f in sorted(sub.glob("*" + SUFFIX))]


def read_chunk_file(ns: Any, path: Path) -> tuple[Any, memoryview]:
    """The verified (meta, payload) of one chunk file of namespace ``ns``; ``ChunkError`` or
    ``ValueError`` when it does not verify."""
    from kvtier.chunk import decode

    return decode(ns.digest(), path.read_bytes(), bytes.fromhex(path.name[:64]))


def seed_shared(disk_path: Path, shared: dict[str, Any], log=print) -> SeedResult:
    """Copy every verified chunk under the disk tier directory ``disk_path`` into the shared backend
    ``shared`` (a ``store.shared`` config), one namespace at a time; see the module doc."""
    from kvtier.chunk import ChunkError
    from kvtier.metrics import Telemetry
    from kvtier.tiers.protocol import Deadline
    from kvtier.tiers.registry import open_shared_backend

    cfg = shared_config(shared)
    res = SeedResult()
    t0 = time.perf_counter()
    for ns, files in chunk_files(Path(disk_path)):
        blobs: dict[bytes, tuple[Any, memoryview]] = {}
        for f in files:
            try:
                meta, payload = read_chunk_file(ns, f)
            except (ChunkError, ValueError) as e:
                res.skipped.append(f"{f.name}: {e}")
                continue
            blobs[meta.key] = (meta, payload)
        tier = open_shared_backend(cfg, ns, Telemetry())     # in ``cfg.encoding``, as a store would write
        try:
            metas = {k: m for k, (m, _) in blobs.items()}
            for k in _chain_order(metas):
                meta, payload = blobs[k]
                if tier.put(meta, payload):
                    res.chunks += 1
                    res.nbytes += meta.payload_len
                else:
                    res.refused += 1
            tier.flush(timeout=120)
            found: set[bytes] = set()
            for chain in _leaves_chains(metas):
                found.update(chain[:tier.longest_prefix(chain, Deadline.after(60)).num_chunks])
            res.readable += len(found)
        finally:
            tier.close()
        log(f"[seed] {cfg.kind}: {len(blobs)} chunks, {len(found)} read back")
    res.seconds = time.perf_counter() - t0
    return res


def evict(paths: tuple[str, ...] | list[str]) -> int:
    """Drop the page cache of every file under ``paths`` (fsync first); returns bytes evicted."""
    total = 0
    for p in paths:
        root = Path(p)
        files = [root] if root.is_file() else [q for q in root.rglob("*") if q.is_file()]
        for q in files:
            try:
                fd = os.open(q, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                total += os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
    return total
