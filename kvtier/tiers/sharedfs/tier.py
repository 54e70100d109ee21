"""Shared-filesystem tier: verified chunk files on a POSIX directory that many machines mount.

For JuiceFS, 3FS, CephFS, Lustre, GlusterFS, NFS, YRCloudFile — any filesystem with
atomic ``rename`` inside one directory tree. Safe with concurrent writers on different
machines and no lock: names are content addresses (``layout``), a chunk is
written to ``tmp/`` and renamed into ``chunks/``, a duplicate write replaces identical
bytes, every read is verified (``kvtier.chunk``) and a torn, truncated, half-visible or
vanished file is a counted miss. The budget belongs to the elected janitor
(``janitor``), never to the write path.

Batched calls fan out over a fixed ``DaemonPool`` (``lookup_threads`` for existence
checks, ``max_inflight`` for reads — a network stat or read is a round trip) and wait at
most the caller's deadline: answers not in by then are UNAVAILABLE("timeout"). While
the mount is missing, read-only or answering ENOTCONN/EIO, the tier is *down* (no I/O;
reads/lookups UNAVAILABLE, writes dropped) or *read-only* (writes dropped), each counted
and logged once per burst; a background probe every ``probe_interval_s`` resumes it.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from typing import Sequence

from kvtier.chunk import ChunkError, ChunkMeta, encode_header, read_limit
from kvtier.config import SharedFsConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import RemoteTier, TierUsage, as_byte_view, copy_bytes
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.diskio import unlink_quiet
from kvtier.tiers.protocol import Capabilities, Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem
from kvtier.tiers.sharedfs import io as sio
from kvtier.tiers.sharedfs.janitor import Janitor
from kvtier.tiers.sharedfs.layout import HOST, TIER, Layout, Stamps
from kvtier.tiers.sharedfs.mount import DOWN, OK, READ_ONLY, Mount
from kvtier.tiers.sharedfs.writer import WriteQueue

COPY_MARGIN_S = 0.05    # batched calls give up this much before their deadline (never past it)
BAD_GRACE_S = 10.0      # a file failing verification is removed once renamed into place this long ago


class SharedFsTier(RemoteTier):
    name = TIER
    capabilities = Capabilities(shared=True, evicts_itself=True, complete_index=False, local_budget=False)

    def __init__(self, cfg: SharedFsConfig, namespace: Namespace, telemetry: Telemetry) -> None:
        super().__init__()
        self.cfg = cfg
        self.namespace = namespace
        self.layout = Layout(cfg.path, namespace, cfg.dir_levels)
        self._ns = namespace.digest()
        self._tm = telemetry
        self.events = Bursts(telemetry, TIER)
        self.stamps = Stamps()
        self.mount = Mount(self.layout, namespace, self.events)
        self._stats = sio.DaemonPool(cfg.lookup_threads, "kvtier-sharedfs-stat")
        self._reads = sio.DaemonPool(cfg.max_inflight, "kvtier-sharedfs-read")
        self._writer = WriteQueue(cfg.writer_threads, cfg.queue_depth, self._write_one, self._touch)
        self._seq = itertools.count()
        self._used, self._files = 0, 0
        self.janitor = Janitor(self.layout, cfg, self.events, cfg.lookup_threads) if cfg.janitor else None
        self._stop = threading.Event()
        self._maint: threading.Thread | None = None
        self._closed = False

    @property
    def state(self) -> str:
        """``OK``, ``READ_ONLY`` or ``DOWN`` (``Mount``)."""
        return self.mount.state

    @state.setter
    def state(self, value: str) -> None:
        self.mount.state = value

    @classmethod
    def open(cls, cfg: SharedFsConfig, namespace: Namespace, telemetry: Telemetry | None = None) -> "SharedFsTier":
        """Check the mount (a missing or read-only one is not an error: the tier starts down or
        read-only and a background probe resumes it), start writers and the janitor thread."""
        self = cls(cfg, namespace, telemetry or Telemetry())
        if cfg.create:
            try:
                cfg.path.mkdir(parents=True, exist_ok=True)
            except OSError:
                pass
        self.mount.probe()
        self._writer.start()
        self._maint = threading.Thread(target=self._maintain, name="kvtier-sharedfs-janitor", daemon=True)
        self._maint.start()
        return self

    def _maintain(self) -> None:
        last_janitor = float("-inf")
        while not self._stop.wait(min(self.cfg.probe_interval_s, self.cfg.janitor_interval_s)):
            if self.state != OK:
                self.mount.probe()
            self._refresh_usage()
            if self.janitor is not None and self.state == OK and \
                    time.monotonic() - last_janitor >= self.cfg.janitor_interval_s:
                last_janitor = time.monotonic()
                self.janitor_tick()

    def janitor_tick(self) -> bool:
        """Try to hold the lease; if held, run one eviction pass. True if a pass ran."""
        if self.janitor is None:
            return False
        try:
            if not self.janitor.lease.try_hold():
                return False
            r = self.janitor.run_pass()
        except OSError as e:
            self.mount.os_error(e, "janitor")
            return False
        self._used, self._files = r.used_bytes - r.freed_bytes, r.files - r.evicted
        if r.evicted:
            self._tm.evicted(TIER, r.evicted)
        self._tm.usage(TIER, self._used, self.cfg.capacity)
        return True

    def _refresh_usage(self) -> None:
        data = self.layout.read_json(self.layout.usage)
        if data is not None:
            self._used, self._files = int(data.get("used_bytes", 0)), int(data.get("files", 0))

    # -- batched calls -----------------------------------------------------------------------------
    def _wait(self, b: sio.Batch, deadline: Deadline) -> bool:
        """Wait until the batch is complete or the deadline; then mark it abandoned and wait out
        copies in progress (memcpy, never I/O). Returns whether it completed."""
        if deadline.at == float("inf"):
            timeout = None
        else:     # stop a little early: a wrapper waiting on the same deadline (GuardedTier) must
            rem = deadline.remaining()      # see us return before it hands the buffers back
            timeout = rem - min(COPY_MARGIN_S, 0.1 * rem)
        with b.cond:
            ok = b.cond.wait_for(lambda: b.complete, timeout)
            b.abandoned = True
            b.cond.wait_for(lambda: b.copying == 0)
        return ok

    @staticmethod
    def _busy(pool: sio.DaemonPool, n: int) -> bool:
        """Too many jobs already waiting (threads stuck in a stalled mount): answer at once."""
        return pool.backlog() > 4 * pool.size

    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        """Stat the keys in parallel (head first); the answer is in once the chain's first gap is
        known. Keys past a known gap are not checked. Never waits past ``deadline``."""
        n = len(keys)
        if n == 0:
            return PrefixResult(0, Status.HIT)
        if self.state == DOWN or self._busy(self._stats, n):
            return PrefixResult(0, Status.UNAVAILABLE)
        b = sio.Batch(n, prefix=True)

        def job(i: int) -> None:
            key = keys[i]
            try:
                m = sio.stat_chunk(self.layout.path_of(key))
                v: object = m is not None
                if m is not None:
                    self.stamps.set(key, m)
            except OSError as e:
                v = None if self.mount.os_error(e, "stat") is Status.UNAVAILABLE else False
            b.put(i, v)

        sio.fan_out(self._stats, b, job)
        self._wait(b, deadline)
        found = 0
        for i in range(n):
            if not b.filled[i] or b.values[i] is not True:
                break
            found += 1
        if found == n:
            return PrefixResult(n, Status.HIT)
        if b.filled[found] and b.values[found] is False:
            return PrefixResult(found, Status.MISS)
        if not b.filled[found]:
            self.events.fault("timeout", f"lookup of {n} chunks not answered in time")
        return PrefixResult(found, Status.UNAVAILABLE)

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                  deadline: Deadline, *, lent: bool = False) -> list[ReadResult]:
        """Read and verify the keys in parallel into their buffers; not done by ``deadline``:
        UNAVAILABLE("timeout"). Not ``lent``: each read lands in the thread's bounce buffer and is
        copied out only while the caller still waits (a late read never touches the caller's
        buffer). ``lent``: the payload is read straight into the caller's buffer (no copy); a
        buffer whose result is not HIT may still be written after the call returned."""
        n = len(keys)
        views = [as_byte_view(o, writable=True) for o in outs]
        if self.state == DOWN:
            return [ReadResult.unavailable("down")] * n
        if self._busy(self._reads, n):
            return [ReadResult.unavailable("busy")] * n
        t0 = time.perf_counter()
        b = sio.Batch(n, prefix=False)
        mtimes = [0] * n

        def job(i: int) -> None:
            key = keys[i]
            try:
                if lent:
                    meta, mtimes[i] = sio.read_chunk_into(self.layout.path_of(key), views[i], self._ns, key)
                    return b.put(i, ReadResult.hit(meta))
                meta, payload, mtimes[i] = sio.read_chunk(self.layout.path_of(key), len(views[i]), self._ns, key)
            except (FileNotFoundError, NotADirectoryError):
                self.stamps.drop(key)
                self.events.fault("missing", f"{key.hex()[:16]} vanished after lookup")
                return b.put(i, ReadResult.miss("missing"))
            except ChunkError as e:
                removed = self._remove_bad(key)
                self.events.fault(e.kind, f"{key.hex()[:16]}: {e}{' (removed)' if removed else ''}")
                return b.put(i, ReadResult.miss(e.kind))
            except ValueError as e:   # a well-formed header, a payload larger than the buffer: never an
                self.events.fault("wrong_size", f"{key.hex()[:16]}: {e}")   # exception for what another machine wrote
                return b.put(i, ReadResult.miss("wrong_size"))
            except OSError as e:
                st = self.mount.os_error(e, f"read {key.hex()[:16]}")
                return b.put(i, ReadResult(st, None, "down" if st is Status.UNAVAILABLE else "io"))
            with b.cond:
                if b.abandoned:
                    return b.put_locked(i, ReadResult.unavailable("timeout"))
                b.copying += 1
            try:
                copy_bytes(views[i][:meta.payload_len], payload)
            finally:
                with b.cond:
                    b.copying -= 1
                    b.put_locked(i, ReadResult.hit(meta))
                    if b.copying == 0:
                        b.cond.notify_all()

        sio.fan_out(self._reads, b, job)
        if not self._wait(b, deadline):
            self.events.fault("timeout", f"read of {n} chunks not done in time")
        results: list[ReadResult] = []
        for i in range(n):
            v = b.values[i] if b.filled[i] else ReadResult.unavailable("timeout")
            results.append(v)  # type: ignore[arg-type]
        self._account(keys, results, mtimes, time.perf_counter() - t0)
        return results

    def _remove_bad(self, key: bytes) -> bool:
        """Unlink a chunk file that failed verification once it has been in place a while
        (ctime: the rename) — a lookup would otherwise claim it again and again. A file renamed
        in the last ``BAD_GRACE_S`` may be another machine's write in progress on a mount without
        close-to-open: left alone."""
        path = self.layout.path_of(key)
        try:
            if time.time() - os.stat(path).st_ctime < BAD_GRACE_S:
                return False
            os.unlink(path)
        except OSError:
            return False
        self.stamps.drop(key)
        return True

    def _account(self, keys: Sequence[ChunkKey], results: list[ReadResult], mtimes: list[int], dt: float) -> None:
        """Telemetry, stamps, and a background refresh of stale access stamps (head newest)."""
        now = time.time_ns()
        stale = -1
        for i, r in enumerate(results):
            if r.ok and r.meta is not None:
                self._tm.hit(TIER, r.meta.payload_len, dt)
                self.stamps.set(keys[i], mtimes[i])
                if now - mtimes[i] > self.cfg.touch_interval_s * 1e9:
                    stale = i
            else:
                self._tm.miss(TIER)
        if stale >= 0:
            touch = [(keys[i], now - i * Stamps.STEP_NS) for i in range(stale + 1) if results[i].ok]
            self._writer.submit_touch(touch)

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        """Queue background writes (never blocks). False per item dropped: down or read-only
        mount, shared budget over ``overfill`` (janitor behind), or a full queue."""
        why = None
        if self.state != OK:
            why = ("shared_down", "mount is down") if self.state == DOWN else ("read_only", "mount is read-only")
        elif self._used > self.cfg.capacity * self.cfg.overfill:
            why = ("shared_full", f"shared budget full ({self._used} of {self.cfg.capacity} B): janitor behind")
        now = time.time_ns()
        accepted: list[bool] = []
        for item in items:
            outcome = "refused"
            if why is None:
                stamp = self.stamps.for_write(item.meta.parent, now)
                payload = item.payload if item.release is not None else memoryview(bytes(item.payload))
                outcome = self._writer.submit(item.meta, payload, item.release, on_done, stamp)
                if outcome == "queued":
                    self.stamps.set(item.meta.key, stamp)
                    accepted.append(True)
                    continue
                if outcome == "full":
                    why = ("dropped_store", "shared write queue full")
            if item.release is not None:
                item.release()
            accepted.append(outcome == "duplicate")
            if outcome == "duplicate":
                if on_done is not None:
                    on_done(item.meta.key, True)     # the queued write of the same key carries it
            elif why is not None:
                self.events.fault(why[0], why[1])
        return accepted

    def _write_one(self, meta: ChunkMeta, payload: memoryview, stamp: int) -> bool:
        if len(payload) != meta.payload_len:
            raise ValueError(f"payload is {len(payload)} bytes, meta says {meta.payload_len}")
        t0 = time.perf_counter()
        final = self.layout.path_of(meta.key)
        tmp = f"{self.layout.tmp}/{meta.key.hex()}.{HOST}.{os.getpid()}.{threading.get_ident()}.{next(self._seq)}.tmp"
        try:
            sio.write_chunk(tmp, encode_header(self._ns, meta), payload, fsync=self.cfg.fsync, stamp_ns=stamp)
            try:
                sio.publish(tmp, final)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                sio.publish(tmp, final)
        except OSError as e:
            unlink_quiet(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.events.fault("enospc", f"write {meta.key.hex()[:16]}: {e}")
            elif e.errno == errno.EROFS:
                self.state = READ_ONLY
                self.events.fault("read_only", f"write: {e}")
            else:
                self.mount.os_error(e, f"write {meta.key.hex()[:16]}")
            return False
        self._tm.wrote(TIER, meta.payload_len, time.perf_counter() - t0)
        return True

    def _touch(self, stamps: list[tuple[bytes, int]]) -> None:
        for key, stamp in reversed(stamps):     # tail first: the head's newer stamp lands last
            try:
                os.utime(self.layout.path_of(key), ns=(stamp, stamp))
                self.stamps.set(key, stamp)
            except OSError:
                return

    def _release_lease(self) -> None:
        try:
            if self.janitor is not None:
                self.janitor.lease.release()
        except OSError:
            pass

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:  # type: ignore[override]
        return sum(self.delete(k) for k in keys)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.flush(timeout)

    def usage(self) -> TierUsage:
        """The janitor's last count (any process's janitor; published on the mount)."""
        return TierUsage(self._used, self.cfg.capacity, self._files)

    # -- per-key calls the batched ones do not cover (contains, get_into, index calls: RemoteTier) --
    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        try:
            size = os.stat(self.layout.path_of(key)).st_size if self.state != DOWN else -1
        except OSError:
            size = -1
        if size < sio.MIN_FILE:
            self._tm.miss(TIER)
            return None
        if size > read_limit(self._ns):       # allocate from a checked size only
            self.events.fault("too_large", f"{key.hex()[:16]}: file of {size} B exceeds store.max_chunk_bytes")
            self._tm.miss(TIER)
            return None
        buf = memoryview(bytearray(size - sio.MIN_FILE))
        try:
            meta = self.get_into(key, buf)
        except ValueError:       # replaced meanwhile by a larger file: a miss
            return None
        return None if meta is None else (meta, buf[:meta.payload_len])

    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        """Synchronous write in the calling thread (copy semantics: nothing kept)."""
        if self.state != OK:
            self.events.fault("shared_down" if self.state == DOWN else "read_only", "put refused")
            return False
        stamp = self.stamps.for_write(meta.parent, time.time_ns())
        ok = self._write_one(meta, as_byte_view(payload), stamp)
        if ok:
            self.stamps.set(meta.key, stamp)
        return ok

    def delete(self, key: ChunkKey) -> bool:
        self.stamps.drop(key)
        try:
            os.unlink(self.layout.path_of(key))
            return True
        except OSError:
            return False

    def holds(self, key: ChunkKey) -> bool:
        return key in self.stamps       # seen on the mount recently by this process (no index: the mount is the truth)

    def close(self) -> None:
        """Finish queued writes (up to io_timeout_s), stop threads, give up the lease. Never hangs
        on a stalled mount (threads are daemons and are not joined)."""
        if self._closed:
            return
        self._closed = True
        self.flush(self.cfg.io_timeout_s)
        self._stop.set()
        self._writer.close()
        if self.janitor is not None and self.state == OK:
            t = threading.Thread(target=self._release_lease, name="kvtier-sharedfs-release", daemon=True)
            t.start()
            t.join(self.cfg.lookup_timeout_s)     # a stalled mount: the lease simply expires
        self._stats.close()
        self._reads.close()


__all__ = ["SharedFsTier"]
