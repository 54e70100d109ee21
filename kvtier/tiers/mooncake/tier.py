"""The Mooncake Store shared tier, through Mooncake's Python client (TCP here, RDMA where available).

Object ``<prefix>/<namespace id>/<chunk key hex>`` holds the same verified chunk format as the disk
tier (4 KiB header + payload + trailer), written and read **scatter-gather**: the payload moves
straight between Mooncake and the caller's buffer (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``), only the header and trailer go through a small scratch area.
With RDMA the buffers are registered for the duration of the call; the TCP transport needs no
registration (it reads the socket straight into them).

Mooncake semantics and what the tier does about them (tests/integration/test_mooncake_*.py):

* ``put`` of an existing key is refused by some versions (``OBJECT_ALREADY_EXISTS``): the chunk is
  there, so the write counts as done; the duplicate is counted once per burst, never an error storm.
* Reads hold a lease on the object (``default_kv_lease_ttl`` of the master) so it is not evicted
  mid-transfer; nothing to do on our side but to keep reads short.
* Objects live in the segment of a client: a client that lends memory (``segment_bytes`` > 0) takes
  its objects with it when it exits. kvtier's default is ``segment_bytes: 0`` (store into other
  clients' segments): run a standalone pool owner (``client`` or
  tests/services/mooncake_pool_owner.py). A vanished object is a counted miss.
* The master evicts when the pool is full (high watermark); a put it cannot place returns
  ``NO_AVAILABLE_HANDLE``: ``False`` + a ``full`` event once per burst.
* Bounded reads: ``read_into`` moves at most the caller's buffer (payload) plus a fixed scratch area
  (header, trailer); ``get`` allocates from ``get_size`` only after checking it against the
  namespace's read limit (``store.max_chunk_bytes``; larger: a ``too_large`` miss, removed).
* Deadlines: existence checks run on a helper thread and are abandoned at the deadline
  (``UNAVAILABLE``: they touch no caller memory); reads and writes are bounded by the client's own
  RPC / transfer timeouts, derived from ``io_timeout_s`` (see ``client``). A master absent at
  start is retried in the background; a restarted master is reconnected by the client itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import Any, Iterable, Sequence

import numpy as np

from kvtier.chunk import HEADER_SIZE, TRAILER_SIZE, ChunkError, ChunkMeta, checksum, decode_header, encode_header, \
    file_size, pack_trailer, read_limit, verify_digest
from kvtier.config import MooncakeConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import RemoteTier, TierUsage, as_byte_view
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.mooncake.client import (INVALID_PARAMS, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, TRANSFER_FAIL,
                                          Client, fault_kind, import_store)
from kvtier.tiers.protocol import Capabilities, Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem

log = logging.getLogger("kvtier.mooncake")
_SCRATCH = HEADER_SIZE + 32   # per key: header region + trailer (padded)


def _ptr(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class MooncakeTier(RemoteTier):
    """See the module docstring. Construct with ``open``; thread-safe."""

    name = "mooncake"
    capabilities = Capabilities(shared=True, evicts_itself=True, complete_index=False, local_budget=False)

    def __init__(self, cfg: MooncakeConfig, namespace: Namespace, telemetry: Telemetry, client: Client) -> None:
        super().__init__()
        self.cfg = cfg
        self._ns = namespace.digest()
        self._prefix = f"{cfg.key_prefix}/{namespace.short_id()}/"
        self._tm = telemetry
        self._bursts = Bursts(telemetry, self.name)
        self._client = client
        self._lookups = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-mooncake-lookup")
        self._stuck = 0
        self._lock = threading.Lock()
        self._written = [0, 0]  # bytes, chunks this process stored

    @classmethod
    def open(cls, cfg: MooncakeConfig, namespace: Namespace, telemetry: Telemetry) -> "MooncakeTier":
        """Start the client's set-up (background; waits up to ``lookup_timeout_s`` for a first answer)."""
        import_store()
        client = Client(cfg)
        tier = cls(cfg, namespace, telemetry, client)
        client.start(wait_s=max(cfg.lookup_timeout_s, 2.0))
        if client.store is None:
            tier._bursts.fault("down", f"master {cfg.master} not reachable at open")
        return tier

    def _ok(self) -> Any:
        return self._client.store

    def _name(self, key: ChunkKey) -> str:
        return self._prefix + key.hex()

    def _fault(self, rc: int, what: str) -> str:
        kind = fault_kind(rc)
        self._bursts.fault(kind, f"{what} via master {self.cfg.master}: rc={rc}")
        return kind

    def _register(self, store: Any, views: list[memoryview]) -> list[int]:
        if self.cfg.protocol != "rdma":
            return []
        done = []
        for v in views:
            p = _ptr(v)
            if p and store.register_buffer(p, len(v)) == 0:
                done.append(p)
        return done

    @staticmethod
    def _unregister(store: Any, ptrs: list[int]) -> None:
        for p in ptrs:
            store.unregister_buffer(p)

    # -- batched calls -----------------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        """One ``batch_is_exist``; abandoned (UNAVAILABLE) at the deadline or ``lookup_timeout_s``."""
        if not keys:
            return PrefixResult(0, Status.HIT)
        store = self._ok()
        if store is None or deadline.expired():
            return PrefixResult(0, Status.UNAVAILABLE)
        with self._lock:
            if self._stuck >= 2:  # both helper threads still wait on a stalled master: do not queue
                return PrefixResult(0, Status.UNAVAILABLE)
            self._stuck += 1
        fut = self._lookups.submit(store.batch_is_exist, [self._name(k) for k in keys])
        fut.add_done_callback(self._unstick)
        try:
            answers = fut.result(timeout=deadline.cap(self.cfg.lookup_timeout_s).remaining())
        except cf.TimeoutError:
            self._bursts.fault("timeout", f"existence check via master {self.cfg.master}")
            return PrefixResult(0, Status.UNAVAILABLE)
        except Exception as exc:
            self._bursts.fault("down", f"existence check: {type(exc).__name__}")
            return PrefixResult(0, Status.UNAVAILABLE)
        n = 0
        for a in answers:
            if a == 1:
                n += 1
                continue
            if a == 0:
                self._bursts.ok()
                return PrefixResult(n, Status.MISS)
            self._fault(a, "existence check")
            return PrefixResult(n, Status.UNAVAILABLE)
        self._bursts.ok()
        return PrefixResult(n, Status.HIT)

    def _unstick(self, _fut: Any) -> None:
        with self._lock:
            self._stuck -= 1

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                  deadline: Deadline, *, lent: bool = False) -> list[ReadResult]:
        """Scatter reads: header+trailer into scratch, payload into the caller's buffer, then verified.
        A buffer larger than the payload costs one size query and a second read for that key."""
        n = len(keys)
        store = self._ok()
        if store is None:
            return [ReadResult.unavailable("down")] * n
        if deadline.expired():
            return [ReadResult.unavailable("timeout")] * n
        views = [as_byte_view(o, writable=True) for o in outs]
        names = [self._name(k) for k in keys]
        scratch = np.zeros(max(1, n) * _SCRATCH, dtype=np.uint8)
        base = int(scratch.ctypes.data)
        reg = self._register(store, views)
        try:
            res = self._read(store, names, views, list(range(n)), [len(v) for v in views], base, keys,
                             scratch, retry=True)
        finally:
            self._unregister(store, reg)
        return res

    def _read(self, store: Any, names: list[str], views: list[memoryview], idx: list[int], plens: list[int],
              base: int, keys: Sequence[ChunkKey], scratch: np.ndarray, retry: bool) -> list[ReadResult]:
        ptrs = [[base + i * _SCRATCH, _ptr(views[i]), base + i * _SCRATCH + HEADER_SIZE] for i in idx]
        sizes = [[HEADER_SIZE, p, TRAILER_SIZE] for p in plens]
        rcs = store.batch_get_into_multi_buffers([names[i] for i in idx], ptrs, sizes)
        out: list[ReadResult] = [ReadResult.unavailable("timeout")] * len(views) if retry else []
        again: list[tuple[int, int]] = []
        for j, (i, rc) in enumerate(zip(idx, rcs)):
            if rc >= 0:
                r = self._verify(keys[i], scratch, i, views[i], rc)
            elif rc == OBJECT_NOT_FOUND:
                self._tm.event("missing", self.name, f"{keys[i].hex()[:16]} absent (evicted or owner gone)")
                r = ReadResult.miss("absent")
            elif retry and rc in (TRANSFER_FAIL, INVALID_PARAMS):
                size = store.get_size(names[i])  # the buffer did not match the object's size
                if size < 0:
                    r = ReadResult.miss("absent") if size == OBJECT_NOT_FOUND else \
                        ReadResult.unavailable(self._fault(size, "read"))
                elif size - HEADER_SIZE - TRAILER_SIZE > len(views[i]) or size < HEADER_SIZE + TRAILER_SIZE:
                    self._tm.event("wrong_size", self.name, f"{keys[i].hex()[:16]}: object of {size} B")
                    r = ReadResult.miss("wrong_size")
                else:
                    again.append((i, size - HEADER_SIZE - TRAILER_SIZE))
                    continue
            else:
                r = ReadResult.unavailable(self._fault(rc, "read"))
            if retry:
                out[i] = r
            else:
                out.append(r)
        if again:
            second = self._read(store, names, views, [i for i, _ in again], [p for _, p in again], base, keys,
                                scratch, retry=False)
            for (i, _), r in zip(again, second):
                out[i] = r
        return out

    def _verify(self, key: ChunkKey, scratch: np.ndarray, i: int, out: memoryview, nbytes: int) -> ReadResult:
        s = memoryview(scratch)[i * _SCRATCH:(i + 1) * _SCRATCH]
        header, trailer = s[:HEADER_SIZE], s[HEADER_SIZE:HEADER_SIZE + TRAILER_SIZE]
        try:
            meta = decode_header(header, self._ns, expect_key=key)
            if file_size(meta.payload_len) != nbytes:
                raise ChunkError("torn", f"object is {nbytes} B, header says {file_size(meta.payload_len)}")
            verify_digest(trailer, None)
            verify_digest(trailer, checksum(header, out[:meta.payload_len]))
        except ChunkError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {e}")
            self._remove(self._name(key), force=True)  # bad bytes: drop them despite our own read lease
            return ReadResult.miss(e.kind)
        self._bursts.ok()
        return ReadResult.hit(meta)

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        """Scatter puts from the caller's payload buffers (zero-copy); synchronous: ``release`` and
        ``on_done`` run for every item before this returns. A chunk whose transfer failed on the way
        (``TRANSFER_FAIL``: the master revoked its space) is put once more; a second failure is a counted
        fault and the chunk is not stored."""
        ok = [False] * len(items)
        try:
            store = self._ok()
            if store is None or not items:
                return ok
            scratch = np.zeros(len(items) * _SCRATCH, dtype=np.uint8)
            base = int(scratch.ctypes.data)
            ptrs, sizes = [], []
            payloads = [as_byte_view(it.payload) for it in items]
            for i, it in enumerate(items):
                header = encode_header(self._ns, it.meta)
                trailer = pack_trailer(checksum(header, payloads[i]))
                scratch[i * _SCRATCH:i * _SCRATCH + HEADER_SIZE] = np.frombuffer(header, np.uint8)
                scratch[i * _SCRATCH + HEADER_SIZE:i * _SCRATCH + HEADER_SIZE + TRAILER_SIZE] = \
                    np.frombuffer(trailer, np.uint8)
                ptrs.append([base + i * _SCRATCH, _ptr(payloads[i]), base + i * _SCRATCH + HEADER_SIZE])
                sizes.append([HEADER_SIZE, it.meta.payload_len, TRAILER_SIZE])
            reg = self._register(store, payloads)
            names = [self._name(it.meta.key) for it in items]
            try:
                rcs = list(store.batch_put_from_multi_buffers(names, ptrs, sizes, self._client.replicate))
                again = [i for i, rc in enumerate(rcs) if rc == TRANSFER_FAIL]
                if again:   # a transfer that failed on the way (the master revoked its space): once more
                    self._bursts.fault("transfer_failed", f"write via master {self.cfg.master}: rc={TRANSFER_FAIL} "
                                       f"for {len(again)} of {len(items)} chunks; retried once")
                    second = store.batch_put_from_multi_buffers([names[i] for i in again], [ptrs[i] for i in again],
                                                                [sizes[i] for i in again], self._client.replicate)
                    for i, rc in zip(again, second):
                        rcs[i] = rc
            finally:
                self._unregister(store, reg)
            for i, rc in enumerate(rcs):
                if rc == 0:
                    ok[i] = True
                    with self._lock:
                        self._written[0] += file_size(items[i].meta.payload_len)
                        self._written[1] += 1
                elif rc == OBJECT_ALREADY_EXISTS:
                    ok[i] = True  # another writer stored this chunk first: harmless
                    self._bursts.fault("duplicate_put", "chunk already stored (counted once per burst)")
                else:
                    self._fault(rc, "write")
            if any(ok):
                self._bursts.ok()
            return ok
        finally:
            for i, it in enumerate(items):
                if it.release is not None:
                    try:
                        it.release()
                    except Exception:
                        log.exception("kvtier mooncake: a write item's release() raised")
                if on_done is not None:
                    on_done(it.meta.key, ok[i])

    def _remove(self, name: str, force: bool = False) -> bool:
        store = self._ok()
        if store is None:
            return False
        try:
            return store.remove(name, force) == 0
        except Exception:
            return False

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        return sum(self._remove(self._name(k)) for k in keys)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def usage(self) -> TierUsage:
        """This process's view: bytes and chunks it stored (the pool's budget is the master's)."""
        with self._lock:
            used, count = self._written
        return TierUsage(used, used, count)

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # -- per-key calls the batched ones do not cover (the rest: RemoteTier) ----------------------
    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        store = self._ok()
        if store is None:
            return None
        size = store.get_size(self._name(key))
        if size < HEADER_SIZE + TRAILER_SIZE:
            return None
        if size > read_limit(self._ns):   # allocate from a checked size only
            self._tm.event("too_large", self.name, f"{key.hex()[:16]}: object of {size} B exceeds "
                           "store.max_chunk_bytes")
            self._remove(self._name(key), force=True)
            return None
        buf = memoryview(bytearray(size - HEADER_SIZE - TRAILER_SIZE))
        r = self.read_into([key], [buf], Deadline.after(self.cfg.io_timeout_s))[0]
        return (r.meta, buf[:r.meta.payload_len]) if r.ok and r.meta else None

    def delete(self, key: ChunkKey) -> bool:
        return self._remove(self._name(key))
