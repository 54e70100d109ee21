"""The shared-fs janitor: lease election and expiry, oldest-first (tail-first) eviction."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, Status
from kvtier.tiers.sharedfs.janitor import Janitor, Lease
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.sharedfs.layout import Layout

from tests.unit.sharedfs_helpers import NS, P, bufs, cfg, chain, open_tier, write_all

FILE = P + 4096 + 20


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _layout(tmp: Path) -> Layout:
    t = open_tier(tmp)          # creates the namespace dirs
    t.close()
    return t.layout


def test_one_holder_then_expiry_hands_over(tmp_path) -> None:
    layout = _layout(tmp_path)
    clock = Clock()
    a, b = Lease(layout, 10, clock), Lease(layout, 10, clock)
    assert a.try_hold() and not b.try_hold()
    clock.t += 5
    assert a.try_hold() and not b.try_hold()        # renewed: still a's
    clock.t += 9                                    # 9 s after the renewal: still live
    assert not b.try_hold()
    clock.t += 2                                    # a stopped renewing (dead): expired
    assert b.try_hold()
    assert not a.try_hold()                         # a comes back: b holds it now
    b.release()
    assert a.try_hold()


def _contend(path: str, q) -> None:
    layout = Layout(Path(path), NS, 2)
    q.put(Lease(layout, 60).try_hold())


def test_election_across_processes_has_one_winner(tmp_path) -> None:
    layout = _layout(tmp_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), q)) for _ in range(4)]
    for p in procs:
        p.start()
    wins = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert sum(wins) == 1
    assert layout.read_json(layout.lease)["holder"]


def test_unreadable_lease_is_taken_over(tmp_path) -> None:
    layout = _layout(tmp_path)
    layout.lease.write_text("{half")
    assert not Lease(layout, 10).try_hold()        # fresh: a renewal being written; wait
    old = time.time() - 60
    os.utime(layout.lease, (old, old))
    assert Lease(layout, 10).try_hold()            # left long ago: taken over


def test_eviction_is_oldest_first_and_tail_first(tmp_path) -> None:
    """Three chains written at different times; over budget the janitor removes the oldest
    chain's tail first and never leaves a chunk whose parent is gone."""
    # probe_interval_s too: the tier's maintenance thread wakes every min(probe, janitor) interval and
    # runs its first janitor pass then; on a loaded machine that pass raced the explicit tick below
    t = open_tier(tmp_path, capacity=10 * FILE, low_watermark=0.8, janitor=True, janitor_interval_s=3600,
                  probe_interval_s=3600, lease_ttl_s=7200)
    try:
        chains = [chain(5, seed=s) for s in range(3)]
        for c in chains:
            assert all(write_all(t, c))
            time.sleep(0.01)
        # chain 0 was read recently (its stamps refreshed): chain 1 is now the oldest
        now = time.time_ns()
        for i, (m, _) in enumerate(chains[0]):
            os.utime(t.layout.path_of(m.key), ns=(now - i * 1000, now - i * 1000))
        assert t.janitor_tick()
        r = t.janitor.last
        assert (r.files, r.used_bytes) == (15, 15 * FILE)
        assert r.evicted == 7 and 15 - r.evicted <= 8          # down to 0.8 x 10 files
        left = [[os.path.exists(t.layout.path_of(m.key)) for m, _ in c] for c in chains]
        assert left[0] == [True] * 5                            # recently read: kept
        assert left[1] == [False] * 5                           # oldest chain: gone
        assert left[2] == [True, True, True, False, False]      # next: its tail went first
        assert t.usage().used_bytes == 8 * FILE and t.usage().num_chunks == 8
        keys = [m.key for m, _ in chains[2]]
        assert t.longest_prefix(keys, Deadline.after(5)) .num_chunks == 3
        assert t._tm.snapshot()["evictions.sharedfs"] == 7
    finally:
        t.close()


def test_victim_read_since_scan_is_kept(tmp_path) -> None:
    t = open_tier(tmp_path)
    try:
        items = chain(4)
        assert all(write_all(t, items))
        j = Janitor(t.layout, cfg(tmp_path, capacity=FILE, low_watermark=1.0), Bursts(Telemetry(), "sharedfs"), 2)
        assert j.lease.try_hold()
        mt, sz, keys = j.scan()
        victims = [(k, int(m), int(s)) for m, s, k in zip(mt, sz, keys)]
        touched = items[0][0].key
        os.utime(t.layout.path_of(touched), ns=(time.time_ns() + 10**9,) * 2)   # a reader refreshed it
        n, freed = j._evict(victims)
        assert n == 3 and freed == 3 * FILE
        assert os.path.exists(t.layout.path_of(touched))
    finally:
        t.close()


def test_under_budget_pass_evicts_nothing_and_cleans_dead_temp_files(tmp_path) -> None:
    t = open_tier(tmp_path, janitor=True, janitor_interval_s=3600, probe_interval_s=3600, lease_ttl_s=7200,
                  temp_ttl_s=60)
    try:
        assert all(write_all(t, chain(3)))
        dead = t.layout.tmp / "x.otherhost.1.2.3.tmp"
        dead.write_bytes(b"partial")
        old = time.time() - 3600
        os.utime(dead, (old, old))
        fresh = t.layout.tmp / "y.otherhost.1.2.4.tmp"
        fresh.write_bytes(b"being written")
        assert t.janitor_tick()
        assert t.janitor.last.evicted == 0 and t.janitor.last.temp_removed == 1
        assert not dead.exists() and fresh.exists()
    finally:
        t.close()


def test_background_janitor_keeps_budget_while_writers_write(tmp_path) -> None:
    """Two tiers (two 'machines') share the directory; only one is elected, and the budget is
    restored by the background thread without any lock on the writes."""
    kw = dict(capacity=6 * FILE, janitor=True, janitor_interval_s=0.1, lease_ttl_s=5, probe_interval_s=0.05)
    a, b = open_tier(tmp_path, **kw), open_tier(tmp_path, **kw)
    try:
        for s in range(4):
            assert all(write_all(a if s % 2 else b, chain(4, seed=s)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            n = sum(len(f) for _, _, f in os.walk(a.layout.chunks))
            if n <= 6:
                break
            time.sleep(0.05)
        assert n <= 6
        holders = {a.janitor.lease.holder, b.janitor.lease.holder}
        assert a.layout.read_json(a.layout.lease)["holder"] in holders
        newest = chain(4, seed=3)
        assert a.longest_prefix([m.key for m, _ in newest], Deadline.after(5)).status is Status.HIT
        assert all(r.ok for r in b.read_into([m.key for m, _ in newest], bufs(newest), Deadline.after(5)))
    finally:
        a.close()
        b.close()


def test_lease_without_hard_links_uses_exclusive_create(tmp_path, monkeypatch) -> None:
    layout = _layout(tmp_path)

    def no_links(*_a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    a, b = Lease(layout, 10), Lease(layout, 10)
    assert a.try_hold() and not b.try_hold()
    assert layout.read_json(layout.lease)["holder"] == a.holder


def test_long_pass_renews_its_lease(tmp_path) -> None:
    layout = _layout(tmp_path)
    clock = Clock()
    a, b = Lease(layout, 10, clock), Lease(layout, 10, clock)
    assert a.try_hold()
    clock.t += 6                       # a pass still running past half the lease
    assert a.valid()                   # renewed on the way
    clock.t += 6                       # 12 s after the first hold, 6 s after the renewal
    assert a.valid() and not b.try_hold()
    clock.t += 20                      # the pass's holder died: its lease lapses
    assert not a.valid() and b.try_hold()
