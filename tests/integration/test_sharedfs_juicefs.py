"""The shared-filesystem tier on REAL JuiceFS mounted twice (two "machines", own cache dirs).

The failure drills of the shared-fs tier, each: the tier keeps answering (correct bytes, a miss or
UNAVAILABLE — never wrong bytes, never past the deadline), counts the event and logs it
once per burst, and is used again once the fault is gone."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, Status
from tests.services.fixtures import juicefs  # noqa: F401
from kvtier.services.juicefs import JuiceFs
from tests.unit.sharedfs_helpers import P, bufs, chain, open_tier, write_all

pytestmark = pytest.mark.integration


def _until(check, timeout: float = 20.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(interval)
    return check()


def _shared(fs: JuiceFs):
    a, b = fs.mount("a"), fs.mount("b")
    (a.path / "kv").mkdir()
    assert _until(lambda: (b.path / "kv").is_dir())
    return a, b


def _warnings(caplog, kind: str) -> int:
    return sum(kind in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_written_on_one_mount_read_on_the_other(juicefs: JuiceFs) -> None:
    a, b = _shared(juicefs)
    assert a.cache_dir != b.cache_dir
    ta, tb = open_tier(a.path / "kv"), open_tier(b.path / "kv")
    try:
        items = chain(16, size=P)
        assert all(write_all(ta, items))
        keys = [m.key for m, _ in items]
        assert _until(lambda: tb.longest_prefix(keys, Deadline.after(5)).status is Status.HIT)
        outs = bufs(items)
        res = tb.read_into(keys, outs, Deadline.after(10))
        assert all(r.ok for r in res)
        assert [bytes(o) for o in outs] == [p for _, p in items]
        assert all(write_all(tb, items))          # the same chunks from the other machine: harmless
        assert all(r.ok for r in ta.read_into(keys, bufs(items), Deadline.after(10)))
    finally:
        ta.close()
        tb.close()


def test_mount_missing_at_start_then_mounted(juicefs: JuiceFs, tmp_path: Path) -> None:
    a = juicefs.mount("a")
    (a.path / "kv").mkdir()
    where = juicefs.root / "mnt" / "late"
    where.mkdir(parents=True)                     # the mount point exists, nothing is mounted on it
    tm = Telemetry()
    t = open_tier(where / "kv", tm)
    try:
        items = chain(4)
        keys = [m.key for m, _ in items]
        assert t.state == "down"
        assert t.longest_prefix(keys, Deadline.after(1)).status is Status.UNAVAILABLE
        assert write_all(t, items) == [False] * 4
        assert not (where / "kv").exists()        # nothing written to the local disk under it
        ta = open_tier(a.path / "kv")
        assert all(write_all(ta, items))
        ta.close()
        juicefs.mount("late")
        assert _until(lambda: t.state == "ok")
        assert _until(lambda: t.longest_prefix(keys, Deadline.after(5)).status is Status.HIT)
        assert tm.snapshot()["events.shared_down"] >= 1
    finally:
        t.close()


def test_read_only_mount_serves_reads_and_drops_writes(juicefs: JuiceFs) -> None:
    a = juicefs.mount("a")
    (a.path / "kv").mkdir()
    ta = open_tier(a.path / "kv")
    items = chain(6)
    assert all(write_all(ta, items[:4]))
    ro = juicefs.mount("ro", extra=["--read-only"])
    tm = Telemetry()
    t = open_tier(ro.path / "kv", tm)
    try:
        assert t.state == "read_only"
        keys = [m.key for m, _ in items]
        assert _until(lambda: t.longest_prefix(keys, Deadline.after(5)).num_chunks == 4)
        outs = bufs(items[:4])
        assert all(r.ok for r in t.read_into(keys[:4], outs, Deadline.after(10)))
        assert [bytes(o) for o in outs] == [p for _, p in items[:4]]
        assert write_all(t, items[4:]) == [False, False]
        assert tm.snapshot()["events.read_only"] >= 2
    finally:
        t.close()
        ta.close()


def test_deleted_and_truncated_by_the_other_machine_between_lookup_and_load(juicefs: JuiceFs) -> None:
    a, b = _shared(juicefs)
    ta, tb = open_tier(a.path / "kv"), open_tier(b.path / "kv")
    try:
        items = chain(6)
        keys = [m.key for m, _ in items]
        assert all(write_all(ta, items))
        assert all(r.ok for r in ta.read_into(keys, bufs(items), Deadline.after(10)))   # a's caches warm
        assert _until(lambda: tb.longest_prefix(keys, Deadline.after(5)).num_chunks == 6)
        assert ta.longest_prefix(keys, Deadline.after(5)).num_chunks == 6
        os.unlink(tb.layout.path_of(keys[4]))                 # machine b evicts chunk 4
        p3 = tb.layout.path_of(keys[3])
        os.truncate(p3, os.path.getsize(p3) - 4000)          # ... and truncates chunk 3
        def settled() -> bool:     # a's attribute cache may serve the old size for ~1 s
            res = ta.read_into(keys, bufs(items), Deadline.after(10))
            return [r.status for r in res][3:5] == [Status.MISS, Status.MISS]
        outs = bufs(items)
        assert _until(settled, timeout=10, interval=0.3)
        res = ta.read_into(keys, outs, Deadline.after(10))
        for i, ((m, p), o, r) in enumerate(zip(items, outs, res)):
            assert r.status is (Status.MISS if i in (3, 4) else Status.HIT)
            if r.ok:
                assert bytes(o) == p                          # never wrong bytes
        snap = ta._tm.snapshot()
        assert snap["events.missing"] >= 1 and snap["events.torn"] >= 1
    finally:
        ta.close()
        tb.close()


def test_metadata_server_killed_then_restarted(juicefs: JuiceFs, caplog) -> None:
    a, b = _shared(juicefs)
    tm = Telemetry()
    tb = open_tier(b.path / "kv", tm, lookup_timeout_s=1.0)
    ta = open_tier(a.path / "kv")
    try:
        items = chain(8)
        keys = [m.key for m, _ in items]
        assert all(write_all(ta, items))
        assert _until(lambda: tb.longest_prefix(keys, Deadline.after(5)).status is Status.HIT)
        juicefs.meta.client().save()                          # its snapshot survives the crash
        juicefs.meta.kill()
        time.sleep(1.5)                                      # the mounts' attribute caches expire
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.store"):
            for _ in range(5):
                t0 = time.monotonic()
                r = tb.longest_prefix(keys, Deadline.after(1.0))
                res = tb.read_into(keys[:2], bufs(items[:2]), Deadline.after(1.0))
                assert time.monotonic() - t0 < 10             # bounded: the deadlines, not the outage
                assert r.status is not Status.HIT or r.num_chunks == 8
                for (m, p), rr in zip(items, res):
                    assert rr.status is not Status.HIT or rr.meta == m
        juicefs.meta.restart()
        assert _until(lambda: tb.longest_prefix(keys, Deadline.after(5)).status is Status.HIT, timeout=60,
                      interval=0.5)
        outs = bufs(items)
        assert _until(lambda: all(r.ok for r in tb.read_into(keys, outs, Deadline.after(10))), timeout=30)
        assert [bytes(o) for o in outs] == [p for _, p in items]
        snap = tm.snapshot()
        failures = sum(snap.get(f"events.{k}", 0) for k in ("timeout", "shared_down", "io_error"))
        assert failures >= 1
        for kind in ("timeout", "shared_down", "io_error"):
            assert _warnings(caplog, f"kvtier {kind} event") <= 1     # once per burst
    finally:
        ta.close()
        tb.close()


def test_stalled_mount_bounded_wait_then_resumes(juicefs: JuiceFs, caplog) -> None:
    a, b = _shared(juicefs)
    tm = Telemetry()
    ta = open_tier(a.path / "kv", tm, max_inflight=4, lookup_threads=4)
    tb = open_tier(b.path / "kv")
    try:
        items = chain(8)
        keys = [m.key for m, _ in items]
        assert all(write_all(tb, items))
        assert _until(lambda: ta.longest_prefix(keys, Deadline.after(5)).status is Status.HIT)
        threads_before = threading.active_count()
        a.pause()
        time.sleep(1.5)                                      # the kernel's attribute cache expires
        try:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvtier.store"):
                for _ in range(6):
                    t0 = time.monotonic()
                    r = ta.longest_prefix(keys, Deadline.after(0.5))
                    outs = bufs(items)
                    res = ta.read_into(keys, outs, Deadline.after(0.5))
                    assert time.monotonic() - t0 < 5          # the deadlines bound the wait
                    assert r.status is not Status.HIT or r.num_chunks == 8
                    for (m, p), o, rr in zip(items, outs, res):
                        assert rr.status is not Status.HIT or bytes(o) == p
            assert threading.active_count() <= threads_before + 8   # at most the pools' threads are stuck
            assert tm.snapshot().get("events.timeout", 0) >= 1
            assert _warnings(caplog, "kvtier timeout event") <= 1
        finally:
            a.resume()
        outs = bufs(items)
        assert _until(lambda: all(r.ok for r in ta.read_into(keys, outs, Deadline.after(10))), timeout=30)
        assert [bytes(o) for o in outs] == [p for _, p in items]
    finally:
        a.resume()
        ta.close()
        tb.close()


def test_shared_budget_full_janitor_evicts_oldest(juicefs: JuiceFs) -> None:
    a, b = _shared(juicefs)
    file = P + 4096 + 20
    kw = dict(capacity=12 * file, janitor=True, janitor_interval_s=0.2, lease_ttl_s=10, low_watermark=0.75)
    ta, tb = open_tier(a.path / "kv", **kw), open_tier(b.path / "kv", **kw)
    try:
        chains = [chain(6, seed=s) for s in range(4)]
        for i, c in enumerate(chains):
            assert all(write_all(ta if i % 2 else tb, c))
            time.sleep(0.05)
        def files() -> int:
            return sum(len(f) for _, _, f in os.walk(ta.layout.chunks))
        assert _until(lambda: files() <= 12, timeout=30)          # 24 written, budget 12
        assert _until(lambda: 0 < ta.usage().used_bytes <= 12 * file and 0 < tb.usage().used_bytes <= 12 * file)
        holders = (ta.janitor.lease.holder, tb.janitor.lease.holder)
        assert _until(lambda: (ta.layout.read_json(ta.layout.lease) or {}).get("holder") in holders)
        newest = [m.key for m, _ in chains[3]]
        oldest = [m.key for m, _ in chains[0]]
        assert ta.longest_prefix(newest, Deadline.after(5)).status is Status.HIT
        assert _until(lambda: tb.longest_prefix(oldest, Deadline.after(5)).num_chunks == 0)
        evicted = ta._tm.snapshot().get("evictions.sharedfs", 0) + tb._tm.snapshot().get("evictions.sharedfs", 0)
        assert evicted >= 24 - 12
        assert all(write_all(ta, chain(2, seed=9)))          # writes go on: no lock, no refusal
    finally:
        ta.close()
        tb.close()
