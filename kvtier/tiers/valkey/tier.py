"""The Valkey / Redis shared tier (standalone or cluster), through valkey-py.

Layout: one value per chunk, key ``<prefix>:<namespace id>:{<chunk key hex>}``, holding the same
verified chunk format as the disk tier (``kvtier.chunk``: 4 KiB header + payload + xxh3 trailer).
The braces are a hash tag: every key kvtier derives for a chunk lands in the chunk's slot, while
successive chunks of a prompt still spread over the cluster's nodes.

Guarantees (tests/integration/test_valkey_tier.py, test_valkey_failures.py):

* **Atomic visibility.** A chunk is one ``SET``: a reader sees all of it or nothing. There is no
  separate marker that could outlive its data; a chunk found by ``longest_prefix`` and evicted before
  the read is a counted miss (``missing``).
* **Never wrong bytes.** Every value is verified (magic, version, namespace, key, length, checksum)
  before one byte reaches the caller's buffer; a bad value is a miss, counted under its kind, and
  deleted.
* **One round trip per batch** (per node in cluster mode, the nodes' pipelines in parallel on the
  tier's node threads): existence checks are one pipeline of ``EXISTS``; reads/writes are pipelines
  of ``GETRANGE``/``SET`` in windows of at most ``WINDOW_BYTES``.
* **Deadlines.** Existence checks use a client whose socket timeout is ``lookup_timeout_s``, reads
  and writes one with ``io_timeout_s``; no client retries. Down / timeout / full become
  ``UNAVAILABLE`` / ``False`` plus an event (counted each time, logged once per burst) (``kvtier.tiers.bursts``).
  A dropped connection is replaced on the next call: the tier reconnects by itself.
* **Eviction is the server's.** Run the server with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
  (or ``allkeys-lfu``); with ``noeviction`` a full server rejects writes (``full`` events, reads go
  on). Optional ``ttl_s`` expires chunks. The open-time probe logs the server's policy once.
* **Bounded reads.** Values are read with ``GETRANGE key 0 cap`` where ``cap`` is the caller's buffer
  (plus header and trailer) capped by the namespace's read limit (``store.max_chunk_bytes``): the
  client never allocates more than ``cap + 1`` bytes, whatever the server holds. A longer value is
  a counted miss (``wrong_size``; past the read limit ``too_large``, and deleted).
* **Limits at open.** ``proto-max-bulk-len`` (CONFIG GET; 512 MiB when CONFIG is not allowed) is the
  ``max_chunk_bytes`` capability: the store refuses larger chunks at start with one line.
* **Credentials** come from the config (``username`` / ``password``, a ``SecretStr``) or its
  environment overlay, never from logs: messages name host and port only. A refused password at
  open disables the tier (one error line, ``auth_failed`` event, every call ``UNAVAILABLE``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from kvtier.chunk import ChunkError, ChunkMeta, decode, file_size, read_limit
from kvtier.config import ValkeyConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import RemoteTier, TierUsage, as_byte_view, copy_bytes
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.protocol import Capabilities, Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem
from kvtier.tiers.valkey.conn import Connections, fault_kind, require_client, short
from kvtier.tiers.valkey.server import read_limits, read_usage
from kvtier.tiers.valkey.wire import WINDOW_BYTES, release, send_sets, set_pieces, windows

__all__ = ["ValkeyTier", "WINDOW_BYTES", "send_sets", "set_pieces"]

log = logging.getLogger("kvtier.valkey")

DEFAULT_MAX_BULK = 512 * 2**20   # Valkey's default proto-max-bulk-len
_USAGE_EVERY_S = 10.0


class ValkeyTier(RemoteTier):
    """See the module docstring. Construct with ``open``; thread-safe."""

    name = "valkey"

    def __init__(self, cfg: ValkeyConfig, namespace: Namespace, telemetry: Telemetry,
                 conns: Connections) -> None:
        super().__init__()
        self.cfg = cfg
        self._ns = namespace.digest()
        self._prefix = f"{cfg.key_prefix}:{namespace.short_id()}:".encode()
        self._tm = telemetry
        self._bursts = Bursts(telemetry, self.name)
        self._conns = conns
        self._disabled: str | None = None
        self._limits_known = False
        self._usage = TierUsage(0, 0, 0)
        self._usage_at = 0.0
        self._lock = threading.Lock()
        self._nodes: cf.ThreadPoolExecutor | None = None    # cluster mode: one pipeline per node, in parallel
        self.capabilities = Capabilities(shared=True, evicts_itself=True, complete_index=False,
                                         local_budget=False, max_chunk_bytes=DEFAULT_MAX_BULK)

    @classmethod
    def open(cls, cfg: ValkeyConfig, namespace: Namespace, telemetry: Telemetry) -> "ValkeyTier":
        """Connect lazily and probe the server's limits once (bounded by ``lookup_timeout_s``). An absent
        server is not an error (the tier answers UNAVAILABLE until it is back); refused credentials
        disable the tier with one error line."""
        require_client()
        tier = cls(cfg, namespace, telemetry, Connections(cfg))
        tier._probe(at_open=True)
        return tier

    @property
    def where(self) -> str:
        return self.cfg.url.split("@")[-1]

    # -- probing ---------------------------------------------------------------------------
    def _probe(self, at_open: bool = False) -> None:
        try:
            limits = read_limits(self._conns)
        except Exception as exc:
            kind = fault_kind(exc)
            if kind == "auth_failed" and at_open:
                self._disabled = "the server refused the credentials"
                log.error("kvtier valkey tier at %s disabled: the server refused the credentials (%s)",
                          self.where, type(exc).__name__)
                self._tm.event("auth_failed", self.name, f"{self.where}: credentials refused; tier disabled")
            elif at_open:
                log.warning("kvtier valkey tier: %s not reachable at start (%s); answering 'unavailable' "
                            "until it is", self.where, short(exc))
                self._bursts.fault(kind, f"{self.where} at open: {short(exc)}")
            return
        self._limits_known = True
        if limits.max_bulk:
            self.capabilities = Capabilities(shared=True, evicts_itself=True, complete_index=False,
                                             local_budget=False, max_chunk_bytes=min(limits.max_bulk))
        if at_open and limits.will_not_evict():
            log.warning("kvtier valkey tier at %s: maxmemory=%s policy=%s: the server will not evict chunks "
                        "(set maxmemory and maxmemory-policy allkeys-lru)", self.where,
                        min(limits.maxmemory) if limits.maxmemory else "?",
                        ",".join(sorted(limits.policies)) or "?")

    def _rk(self, key: ChunkKey) -> bytes:
        return self._prefix + b"{" + key.hex().encode() + b"}"

    def _failed(self, exc: BaseException, what: str) -> str:
        kind = fault_kind(exc)
        if kind in ("down", "timeout", "moved"):
            self._conns.node_failed()
        self._bursts.fault(kind, f"{what} at {self.where}: {short(exc)}")
        return kind

    def _per_node(self, groups: Sequence[Any], fn: Callable[[Any], None], timeout: float | None = None) -> None:
        """Run ``fn(group)`` for every node's group at once (inline when there is one) and wait for all,
        or until ``timeout``: a group still running then is abandoned (``fn`` must only write results
        that the caller stops reading). ``fn`` handles its own errors."""
        if len(groups) == 1:
            fn(groups[0])
            return
        with self._lock:
            if self._nodes is None:
                self._nodes = cf.ThreadPoolExecutor(max_workers=max(4, self.cfg.max_inflight),
                                                    thread_name_prefix="kvtier-valkey-node")
            pool = self._nodes
        cf.wait([pool.submit(fn, g) for g in groups], timeout=timeout)

    # -- batched calls -----------------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        """One pipeline of EXISTS (per node); UNAVAILABLE if the first unknown key precedes a miss."""
        if not keys:
            return PrefixResult(0, Status.HIT)
        if self._disabled or deadline.expired():
            return PrefixResult(0, Status.UNAVAILABLE)
        rks = [self._rk(k) for k in keys]
        known: list[bool | None] = [None] * len(keys)
        try:
            groups = self._conns.groups("lookup", rks)
        except Exception as exc:
            self._failed(exc, "lookup")
            return PrefixResult(0, Status.UNAVAILABLE)

        def node(g: Any) -> None:
            if deadline.expired():
                return
            try:
                pipe = g.client.pipeline(transaction=False)
                for i in g.index:
                    pipe.exists(rks[i])
                answers = pipe.execute()
            except Exception as exc:
                self._failed(exc, "lookup")
                return
            for i, v in zip(g.index, answers):
                known[i] = bool(v)

        self._per_node(groups, node, timeout=deadline.remaining())
        answered = list(known)   # a node answering after the deadline writes into ``known`` only
        if any(v is not None for v in answered):
            self._bursts.ok()
        n = 0
        for v in answered:
            if v is None:
                return PrefixResult(n, Status.UNAVAILABLE)
            if not v:
                return PrefixResult(n, Status.MISS)
            n += 1
        return PrefixResult(n, Status.HIT)

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                  deadline: Deadline, *, lent: bool = False) -> list[ReadResult]:
        """Pipelined GETRANGEs (windows of ``WINDOW_BYTES`` by buffer size), each value verified, then copied."""
        n = len(keys)
        if self._disabled:
            return [ReadResult.unavailable("disabled")] * n
        views = [as_byte_view(o, writable=True) for o in outs]
        rks = [self._rk(k) for k in keys]
        res: list[ReadResult | None] = [None] * n
        bad: list[bytes] = []
        try:
            groups = self._conns.groups("io", rks)
        except Exception as exc:
            kind = self._failed(exc, "read")
            return [ReadResult.unavailable(kind)] * n

        def node(g: Any) -> None:
            failed: str | None = None
            for window in windows(g.index, [len(views[i]) for i in g.index]):
                if failed is None and deadline.expired():
                    failed = "timeout"
                if failed is not None:
                    for i in window:
                        res[i] = ReadResult.unavailable(failed)
                    continue
                try:
                    pipe = g.client.pipeline(transaction=False)
                    for i in window:
                        pipe.getrange(rks[i], 0, self._cap(len(views[i])))
                    values = pipe.execute()
                except Exception as exc:
                    failed = self._failed(exc, "read")
                    for i in window:
                        res[i] = ReadResult.unavailable(failed)
                    continue
                self._bursts.ok()
                for i, value in zip(window, values):
                    res[i] = self._verify_into(keys[i], value, views[i], bad, rks[i])

        self._per_node(groups, node)   # every node's reads end (socket timeouts) before the buffers go back
        if bad:
            self._delete_raw(bad)
        return [r if r is not None else ReadResult.unavailable("timeout") for r in res]

    def _cap(self, payload_room: int) -> int:
        """Largest value a read of a chunk with ``payload_room`` payload bytes accepts."""
        return min(file_size(payload_room), read_limit(self._ns))

    def _verify_into(self, key: ChunkKey, value: Any, out: memoryview, bad: list[bytes], rk: bytes) -> ReadResult:
        if not value:   # GETRANGE of a missing key is empty
            self._tm.event("missing", self.name, f"{key.hex()[:16]} absent (evicted or expired)")
            return ReadResult.miss("absent")
        cap = self._cap(len(out))
        if len(value) > cap:   # GETRANGE returned cap + 1 bytes: the value is longer than we accept
            if cap == read_limit(self._ns):
                self._tm.event("too_large", self.name, f"{key.hex()[:16]}: value exceeds store.max_chunk_bytes")
                bad.append(rk)
                return ReadResult.miss("too_large")
            self._tm.event("wrong_size", self.name, f"{key.hex()[:16]}: value > buffer {len(out)} B")
            return ReadResult.miss("wrong_size")
        try:
            meta, payload = decode(self._ns, value, expect_key=key)
        except ChunkError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {e}")
            bad.append(rk)
            return ReadResult.miss(e.kind)
        if meta.payload_len > len(out):
            self._tm.event("wrong_size", self.name, f"{key.hex()[:16]}: {meta.payload_len} B > buffer {len(out)} B")
            return ReadResult.miss("wrong_size")
        copy_bytes(out[:meta.payload_len], payload)
        return ReadResult.hit(meta)

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        """Pipelined SETs (one value per chunk, optional PX ttl); synchronous: every item's ``release`` and
        ``on_done`` run before this returns."""
        ok = [False] * len(items)
        released = [False] * len(items)
        try:
            if self._disabled:
                return ok
            if not self._limits_known:
                self._probe()
            limit = self.capabilities.max_chunk_bytes or DEFAULT_MAX_BULK
            todo = []
            for i, it in enumerate(items):
                if file_size(it.meta.payload_len) > limit:
                    self._bursts.fault("too_large", f"chunk of {file_size(it.meta.payload_len)} B > server "
                                       f"proto-max-bulk-len {limit} B")
                else:
                    todo.append(i)
            rks = [self._rk(items[i].meta.key) for i in todo]
            try:
                groups = self._conns.groups("io", rks)
            except Exception as exc:
                self._failed(exc, "write")
                return ok
            px = int(self.cfg.ttl_s * 1000) if self.cfg.ttl_s else None

            def node(g: Any) -> None:
                pos = [todo[j] for j in g.index]
                rk_of = {todo[j]: rks[j] for j in g.index}
                failed = False
                for window in windows(pos, [file_size(items[i].meta.payload_len) for i in pos]):
                    if failed:
                        break
                    cmds = [set_pieces(self._ns, rk_of[i], items[i].meta, as_byte_view(items[i].payload), px)
                            for i in window]
                    try:
                        answers = send_sets(g.client, cmds)
                    except Exception as exc:
                        self._failed(exc, "write")
                        failed = True
                        continue
                    finally:
                        for i in window:
                            release(items, released, i)
                    self._bursts.ok()
                    for i, a in zip(window, answers):
                        if isinstance(a, Exception):
                            self._failed(a, "write")
                        else:
                            ok[i] = a in (True, b"OK", "OK")

            self._per_node(groups, node)   # payload buffers are released only after every node is done
            self._maybe_usage()
            return ok
        finally:
            for i in range(len(items)):
                release(items, released, i)
                if on_done is not None:
                    on_done(items[i].meta.key, ok[i])

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        return self._delete_raw([self._rk(k) for k in keys])

    def _delete_raw(self, rks: list[bytes]) -> int:
        if not rks or self._disabled:
            return 0
        n = 0
        try:
            for g in self._conns.groups("io", rks):
                pipe = g.client.pipeline(transaction=False)
                for i in g.index:
                    pipe.delete(rks[i])
                n += sum(int(v) for v in pipe.execute(raise_on_error=False) if isinstance(v, int))
        except Exception as exc:
            self._failed(exc, "delete")
        return n

    def _maybe_usage(self) -> None:
        now = time.monotonic()
        if now - self._usage_at < _USAGE_EVERY_S:
            return
        self._usage_at = now
        try:
            self._usage = read_usage(self._conns)
        except Exception:
            return

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def usage(self) -> TierUsage:
        """The servers' used_memory / maxmemory / key count, sampled at most every 10 s during writes
        (no I/O here)."""
        return self._usage

    def close(self) -> None:
        with self._lock:
            pool, self._nodes = self._nodes, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._conns.close()

    # -- per-key calls the batched ones do not cover (the rest: RemoteTier) ----------------------
    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        if self._disabled:
            return None
        limit = read_limit(self._ns)
        try:
            value = self._conns.groups("io", [self._rk(key)])[0].client.getrange(self._rk(key), 0, limit)
        except Exception as exc:
            self._failed(exc, "read")
            return None
        if not value:
            return None
        if len(value) > limit:
            self._tm.event("too_large", self.name, f"{key.hex()[:16]}: value exceeds store.max_chunk_bytes")
            self._delete_raw([self._rk(key)])
            return None
        try:
            meta, payload = decode(self._ns, value, expect_key=key)
        except ChunkError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {e}")
            self._delete_raw([self._rk(key)])
            return None
        return meta, memoryview(bytearray(payload))

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key]) == 1
