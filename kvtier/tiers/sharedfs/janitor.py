"""The shared-filesystem tier's janitor: one elected process keeps the mount under budget.

No lock is ever taken on the write path. Instead every process that opens the tier with
``janitor: true`` runs a background thread that, every ``janitor_interval_s``, tries to
hold the **lease** ``janitor/lease`` (a small JSON file on the filesystem itself):

* no lease file: create it exclusively (``link(2)`` of a complete temp file: the file
  appears whole, and only one creator succeeds, also on NFS);
* our lease: renew it (temp + ``rename``) while it has not expired;
* someone else's lease past its expiry (wall clock; a dead holder stops renewing), or an
  unreadable one not modified for ``lease_ttl_s``: replace it by ``rename`` and read it
  back (the last rename wins). An unreadable fresh lease is a renewal in flight: wait.

Two holders at once are possible for one pass (two processes replacing the same expired
lease) and harmless: a pass only deletes the oldest files and unlinking twice is a no-op.
The holder then runs an **eviction pass**: scan ``chunks/`` (scandir + stat, the top-level
directories in parallel), publish the totals to ``janitor/usage`` (what ``usage()`` and the
writers' overfill check read), and when over ``capacity`` delete the oldest files by access
stamp (mtime; ``Stamps`` keeps a chain's tail older than its head, so tails go first) until
usage is at ``low_watermark`` x capacity. A victim whose stamp moved since the scan (just
read) is skipped. Temp files older than ``temp_ttl_s`` (dead writers) are removed.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtier.config import SharedFsConfig
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.sharedfs.io import DaemonPool
from kvtier.tiers.sharedfs.layout import HOST, Layout


@dataclass(frozen=True, slots=True)
class PassResult:
    files: int              # chunk files found by the scan
    used_bytes: int         # their bytes, before eviction
    evicted: int            # files deleted
    freed_bytes: int
    temp_removed: int
    scan_s: float
    evict_s: float


class Lease:
    """The janitor lease on the mount. ``holder`` is unique per process and open."""

    def __init__(self, layout: Layout, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.layout = layout
        self.ttl = ttl_s
        self.clock = clock
        self.holder = f"{HOST}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.expires = 0.0

    def _record(self) -> dict:
        self.expires = self.clock() + self.ttl
        return {"holder": self.holder, "expires": self.expires, "host": HOST, "pid": os.getpid()}

    def _tmp(self) -> str:
        return f"{self.layout.tmp}/lease.{self.holder.replace(':', '.')}.{time.monotonic_ns()}.tmp"

    def try_hold(self) -> bool:
        """Acquire or renew; True if this process holds the lease now. Raises OSError (mount down)."""
        path = self.layout.lease
        cur = self.layout.read_json(path)
        if cur is None and not path.exists():
            tmp = self._tmp()
            with open(tmp, "w") as f:
                f.write(_dump(self._record()))
            try:
                os.link(tmp, path)          # exclusive create of a complete file
                return True
            except FileExistsError:
                return False
            except OSError:                 # no hard links here (EPERM/ENOTSUP): O_EXCL create instead
                return self._create_excl(path)
            finally:
                os.unlink(tmp)
        now = self.clock()
        if cur is None:     # unreadable: racing a renewal's rename (retry later) or garbage left long ago
            try:
                if time.time() - path.stat().st_mtime < self.ttl:
                    return False
            except FileNotFoundError:
                return False
        if cur is not None and cur.get("holder") == self.holder and float(cur.get("expires", 0)) > now:
            self.layout.write_json(path, self._record())
            return True
        if cur is not None and float(cur.get("expires", 0)) > now:
            return False                    # someone else's live lease
        self.layout.write_json(path, self._record())     # expired (or unreadable): take over
        back = self.layout.read_json(path)
        return back is not None and back.get("holder") == self.holder

    def _create_excl(self, path) -> bool:
        """Exclusive create + write (a reader may briefly see it empty: a fresh unreadable lease,
        which contenders wait on)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, _dump(self._record()).encode())
        finally:
            os.close(fd)
        return True

    def valid(self) -> bool:
        """Our lease has time left; renewed once half of it is gone (a long pass keeps its lease).
        Checked between the scan and the eviction and between deletion batches."""
        if self.clock() >= self.expires - 1.0:
            return False
        if self.clock() > self.expires - self.ttl / 2:
            try:
                return self.try_hold()
            except OSError:
                return False
        return True

    def release(self) -> None:
        """Remove the lease if we hold it (another process takes over at its next tick)."""
        cur = self.layout.read_json(self.layout.lease)
        if cur is not None and cur.get("holder") == self.holder:
            try:
                os.unlink(self.layout.lease)
            except OSError:
                pass


def _dump(d: dict) -> str:
    import json
    return json.dumps(d)


class Janitor:
    def __init__(self, layout: Layout, cfg: SharedFsConfig, events: Bursts, pool_threads: int) -> None:
        self.layout = layout
        self.cfg = cfg
        self.events = events
        self.lease = Lease(layout, cfg.lease_ttl_s)
        self.threads = pool_threads
        self.last: PassResult | None = None

    # -- scan --------------------------------------------------------------------------------
    def _scan_tree(self, top: str, depth: int) -> tuple[list[int], list[int], list[bytes]]:
        mt: list[int] = []
        sz: list[int] = []
        ks: list[bytes] = []
        stack = [(top, depth)]
        while stack:
            d, left = stack.pop()
            try:
                it = os.scandir(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for e in it:
                    if left > 0:
                        if len(e.name) == 2:
                            stack.append((e.path, left - 1))
                        continue
                    key = self.layout.key_of(e.name)
                    if key is None:
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    mt.append(st.st_mtime_ns)
                    sz.append(st.st_size)
                    ks.append(key)
        return mt, sz, ks

    def scan(self) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """(mtime ns, size, key) of every chunk file, the top-level directories in parallel."""
        tops = [e.path for e in os.scandir(self.layout.chunks) if len(e.name) == 2 and e.is_dir()]
        parts: list[tuple[list[int], list[int], list[bytes]]] = []
        errors: list[BaseException] = []
        _parallel(tops, lambda t: parts.append(self._scan_tree(t, self.layout.levels - 1)), self.threads, errors)
        if errors:
            raise errors[0]
        mt = np.fromiter((m for p in parts for m in p[0]), dtype=np.int64)
        sz = np.fromiter((s for p in parts for s in p[1]), dtype=np.int64)
        keys = [k for p in parts for k in p[2]]
        return mt, sz, keys

    def clean_temp(self) -> int:
        cutoff = time.time() - self.cfg.temp_ttl_s
        removed = 0
        for e in os.scandir(self.layout.tmp):
            try:
                if e.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(e.path)
                    removed += 1
            except OSError:
                continue
        return removed

    # -- one pass ------------------------------------------------------------------------------
    def run_pass(self) -> PassResult:
        """Scan, publish usage, evict oldest-first past capacity. Raises OSError (mount down)."""
        t0 = time.perf_counter()
        temp_removed = self.clean_temp()
        mt, sz, keys = self.scan()
        used = int(sz.sum()) if len(sz) else 0
        t1 = time.perf_counter()
        evicted = freed = 0
        if used > self.cfg.capacity and self.lease.valid():
            target = int(self.cfg.capacity * self.cfg.low_watermark)
            order = np.argsort(mt, kind="stable")
            cum = np.cumsum(sz[order])
            n = int(np.searchsorted(cum, used - target, side="left")) + 1
            victims = [(keys[i], int(mt[i]), int(sz[i])) for i in order[:min(n, len(order))]]
            evicted, freed = self._evict(victims)
        t2 = time.perf_counter()
        self.layout.write_json(self.layout.usage, {"used_bytes": used - freed, "files": len(keys) - evicted,
                                                   "at": time.time(), "holder": self.lease.holder})
        self.last = PassResult(len(keys), used, evicted, freed, temp_removed, t1 - t0, t2 - t1)
        return self.last

    def _evict(self, victims: list[tuple[bytes, int, int]]) -> tuple[int, int]:
        """Delete victims oldest first, in batches; skip any whose stamp moved (read since the scan)."""
        lock = threading.Lock()
        done = [0, 0]

        def one(v: tuple[bytes, int, int]) -> None:
            key, stamp, size = v
            path = self.layout.path_of(key)
            try:
                if os.stat(path).st_mtime_ns != stamp:
                    return
                os.unlink(path)
            except FileNotFoundError:
                return
            with lock:
                done[0] += 1
                done[1] += size

        batch = max(64, self.threads * 8)
        errors: list[BaseException] = []
        for i in range(0, len(victims), batch):
            if not self.lease.valid():
                break                          # our lease ran out mid-pass: stop, let the holder work
            _parallel(victims[i:i + batch], one, self.threads, errors)
            if errors:
                raise errors[0]
        return done[0], done[1]


def _parallel(items: list, fn: Callable, threads: int, errors: list[BaseException]) -> None:
    """Run ``fn`` over ``items`` on up to ``threads`` short-lived daemon threads; wait for all.
    OSErrors are collected into ``errors`` (the first one is re-raised by the caller)."""
    if not items:
        return
    it = iter(items)
    lock = threading.Lock()
    finished = threading.Semaphore(0)
    n = min(threads, len(items))

    def worker() -> None:
        try:
            while True:
                with lock:
                    item = next(it, _END)
                if item is _END:
                    return
                try:
                    fn(item)
                except OSError as e:
                    with lock:
                        errors.append(e)
                    return
        finally:
            finished.release()

    pool = DaemonPool(n, "kvtier-sharedfs-janitor")
    for _ in range(n):
        pool.submit(worker)
    for _ in range(n):
        finished.acquire()
    pool.close()


_END = object()

__all__ = ["Janitor", "Lease", "PassResult"]
