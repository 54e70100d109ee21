"""GuardedTier: bounded threads, deadlines, circuit breaker with a background probe, events once
per burst — against a fake backend that stalls (like a SIGSTOPped server or FUSE mount) or fails."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvtier.chunk import ChunkMeta
from kvtier.config import SharedFsConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.guard import PROBE_KEY, GuardedTier
from kvtier.tiers.protocol import Deadline, Status, WriteItem
from tests.unit.fake_tiers import DictSharedTier

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 4096


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def guarded(tmp_path: Path):
    inner = DictSharedTier()
    tm = Telemetry()
    # the caps also bound every healthy call (a pool-thread round trip): 2 s, not 0.2 s, so that a niced run
    # beside a busy integration suite (thread wake-ups of 0.5 s measured) never times a healthy call out
    cfg = SharedFsConfig(path=tmp_path, max_inflight=3, lookup_timeout_s=2.0, io_timeout_s=2.0, probe_interval_s=0.05,
                         write_backlog=12 * P)
    g = GuardedTier.wrap(inner, cfg, tm)
    yield g, inner, tm
    inner.resume()
    g.close()


def meta(key: bytes) -> ChunkMeta:
    return ChunkMeta(key, None, 4, (P,), "uint8", P)


def events(tm: Telemetry) -> dict[str, int]:
    return {k.removeprefix("events."): v for k, v in tm.snapshot().items() if k.startswith("events.")}


def test_passes_through_when_healthy(guarded) -> None:
    g, inner, _ = guarded
    keys = chunk_keys(NS, list(range(16)))
    assert g.capabilities.shared and g.name == inner.name
    buf = bytearray(range(256)) * (P // 256)
    assert all(g.write([WriteItem(meta(k), memoryview(buf)) for k in keys[:3]]))
    buf[:] = b"\0" * P                              # no release: the guard copied before returning
    assert g.flush(5)
    res = g.longest_prefix(keys, Deadline.after(5))
    assert (res.num_chunks, res.status) == (3, Status.MISS)
    out = [bytearray(P) for _ in keys[:4]]
    got = g.read_into(keys[:4], out, Deadline.after(5))
    assert [r.status for r in got] == [Status.HIT] * 3 + [Status.MISS]
    assert bytes(out[0]) == bytes(bytearray(range(256)) * (P // 256))


def test_stalled_backend_times_out_opens_breaker_and_recovers(guarded) -> None:
    g, inner, tm = guarded
    keys = chunk_keys(NS, list(range(8)))
    probes: list[int] = []                                # the background probe's calls (every 0.05 s)
    real_prefix = inner.longest_prefix

    def counted_prefix(ks, deadline):
        if list(ks) == [PROBE_KEY]:
            probes.append(1)                              # before _enter counts it in inner.calls
        return real_prefix(ks, deadline)
    inner.longest_prefix = counted_prefix
    inner.stall()
    t0 = time.monotonic()
    res = g.longest_prefix(keys, Deadline.after(30))      # capped at lookup_timeout_s = 2
    assert res.status is Status.UNAVAILABLE and time.monotonic() - t0 < 15
    assert g.breaker.is_open
    calls, probed = inner.calls, len(probes)
    for _ in range(50):                                   # open: answered at once, no new I/O
        assert g.longest_prefix(keys, Deadline.after(30)).status is Status.UNAVAILABLE
        assert g.read_into(keys[:1], [bytearray(P)], Deadline.after(30))[0].status is Status.UNAVAILABLE
    # no call reached the backend but the probe's (a loaded machine may let it run during the loop)
    assert inner.calls - calls <= len(probes) - probed and g.breaker.refused >= 100
    assert events(tm)["unavailable"] == 1                 # once per burst, not per call
    assert inner.max_blocked <= 3                         # at most max_inflight threads stuck
    inner.resume()
    assert wait_for(lambda: not g.breaker.is_open)        # the probe saw it answer again
    assert g.longest_prefix(keys, Deadline.after(5)).status is Status.MISS
    assert events(tm)["recovered"] == 1


def test_threads_stuck_in_a_stall_are_bounded(guarded) -> None:
    g, inner, tm = guarded
    keys = chunk_keys(NS, list(range(8)))
    inner.stall()
    results: list = []

    def caller() -> None:
        results.append(g.read_into(keys[:1], [bytearray(P)], Deadline.after(0.3))[0].status)
    callers = [threading.Thread(target=caller) for _ in range(20)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(10)
    assert results == [Status.UNAVAILABLE] * 20           # every caller came back by its deadline
    assert inner.max_blocked <= 3
    assert events(tm)["unavailable"] == 1


def test_late_answer_never_lands_in_the_callers_buffer(guarded) -> None:
    g, inner, _ = guarded
    k = chunk_keys(NS, list(range(4)))[0]
    inner.data[k] = (meta(k), b"\x07" * P)
    inner.stall()
    out = bytearray(P)
    assert g.read_into([k], [out], Deadline.after(0.1))[0].status is Status.UNAVAILABLE
    out[:] = b"\x01" * P                                  # caller reuses its buffer
    inner.resume()
    assert wait_for(lambda: inner.blocked == 0)
    time.sleep(0.05)
    assert bytes(out) == b"\x01" * P


def test_lent_buffers_go_to_the_backend_as_they_are(guarded) -> None:
    """``lent``: the backend gets the caller's own buffers (no private copy); a stalled read still
    answers UNAVAILABLE at the deadline, and its late write lands in the lent buffer (which the
    caller, by lending it, gave up)."""
    g, inner, _ = guarded
    k = chunk_keys(NS, list(range(4)))[0]
    inner.data[k] = (meta(k), b"\x07" * P)
    seen: list[int] = []
    real = inner.read_into

    def spy(keys, outs, deadline, *, lent=False):
        seen.extend(memoryview(o).obj is out for o in outs)
        return real(keys, outs, deadline, lent=lent)

    inner.read_into = spy
    out = bytearray(P)
    assert g.read_into([k], [out], Deadline.after(2), lent=True)[0].ok
    assert bytes(out) == b"\x07" * P and seen == [True]
    assert g.read_into([k], [bytearray(P)], Deadline.after(2))[0].ok and seen == [True, False]
    inner.stall()
    late = bytearray(P)
    assert g.read_into([k], [late], Deadline.after(0.1), lent=True)[0].status is Status.UNAVAILABLE
    inner.resume()
    assert wait_for(lambda: bytes(late) == b"\x07" * P)


def test_failing_backend_is_unavailable_and_writes_are_dropped(guarded) -> None:
    g, inner, tm = guarded
    keys = chunk_keys(NS, list(range(40)))
    inner.fail = True
    assert g.longest_prefix(keys, Deadline.after(5)).status is Status.UNAVAILABLE
    assert g.breaker.is_open
    released = []
    ok = g.write([WriteItem(meta(k), memoryview(bytearray(P)), lambda: released.append(1)) for k in keys])
    assert not any(ok) and len(released) == len(keys)     # dropped, every pinned buffer released
    assert events(tm)["dropped_store"] == 1               # once per burst
    inner.fail = False
    assert wait_for(lambda: not g.breaker.is_open)


def test_write_backlog_is_bounded_while_stalled(guarded) -> None:
    g, inner, tm = guarded
    keys = chunk_keys(NS, list(range(400)))
    inner.stall()
    done: list[tuple[bytes, bool]] = []
    ok = g.write([WriteItem(meta(k), memoryview(bytearray(P))) for k in keys], lambda k, s: done.append((k, s)))
    assert 0 < sum(ok) <= 12 + 3 * 16                     # queued (12 x P bytes) + in flight; the rest dropped
    inner.resume()
    assert g.flush(10)
    assert len(done) == sum(ok) and all(s for _, s in done)


def test_the_write_backlog_is_counted_in_bytes_whatever_the_entries_size(tmp_path: Path) -> None:
    """Chunks stored per KV head are more, smaller entries: the backlog holds as many bytes of them."""
    queued = {}
    for size in (P, P // 8):
        inner = DictSharedTier()
        cfg = SharedFsConfig(path=tmp_path, max_inflight=1, lookup_timeout_s=2.0, io_timeout_s=30.0,
                             write_backlog=12 * P)
        g = GuardedTier.wrap(inner, cfg, Telemetry())
        try:
            inner.stall()
            first = g.write([WriteItem(ChunkMeta(k, None, 4, (size,), "uint8", size), memoryview(bytearray(size)))
                             for k in chunk_keys(NS, list(range(4)))[:1]])
            assert first == [True] and wait_for(lambda: not g._writes)    # the first batch is in flight, stalled
            keys = chunk_keys(NS, list(range(4 * 400)))
            ok = g.write([WriteItem(ChunkMeta(k, None, 4, (size,), "uint8", size), memoryview(bytearray(size)))
                          for k in keys])
            queued[size] = sum(ok) * size
        finally:
            inner.resume()
            g.close()
    assert queued == {P: 12 * P, P // 8: 12 * P}


class QueueingBackend(DictSharedTier):
    """A backend that, like a shared filesystem's writer, accepts a write into its own queue and lands it
    later (here: when ``land`` is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.land = threading.Event()
        self._queued: list[WriteItem] = []
        self._qlock = threading.Lock()

    def write(self, items, on_done=None):
        with self._qlock:
            self._queued += [WriteItem(it.meta, memoryview(bytes(it.payload))) for it in items]
        for it in items:
            if it.release is not None:
                it.release()
        threading.Thread(target=self._later, args=(on_done,), daemon=True).start()
        return [True] * len(items)

    def _later(self, on_done) -> None:
        self.land.wait()
        with self._qlock:
            done, self._queued = self._queued, []
        for it in done:
            self.data[it.meta.key] = (it.meta, bytes(it.payload))
            if on_done is not None:
                on_done(it.meta.key, True)

    def flush(self, timeout=None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._qlock:
                if not self._queued:
                    return True
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.005)


def test_flush_waits_for_the_backends_own_write_queue(tmp_path: Path) -> None:
    inner = QueueingBackend()
    cfg = SharedFsConfig(path=tmp_path, max_inflight=2, lookup_timeout_s=2.0, io_timeout_s=2.0)
    g = GuardedTier.wrap(inner, cfg, Telemetry())
    try:
        keys = chunk_keys(NS, list(range(8)))
        assert all(g.write([WriteItem(meta(k), memoryview(bytes(P))) for k in keys[:2]]))
        assert wait_for(lambda: inner._queued)            # handed to the backend, not yet written
        assert g.flush(0.2) is False                      # still queued in the backend: not flushed
        assert not inner.data
        inner.land.set()
        assert g.flush(5)
        assert set(inner.data) == set(keys[:2])           # a true flush means written
    finally:
        inner.land.set()
        g.close()
