"""Shared-filesystem tier on a plain local directory: protocol, concurrency, faults, deadlines."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest

from kvtier.metrics import Telemetry
from kvtier.tiers.sharedfs import io as sharedfs_io
from kvtier.tiers.sharedfs import tier as sharedfs
from kvtier.tiers.protocol import Deadline, PrefixResult, Status, WriteItem

from tests.unit.sharedfs_helpers import NS, P, bufs, chain, open_tier, write_all


@pytest.fixture(params=[False, True], ids=["copy", "lent"])
def lent(request) -> bool:
    """read_into with the caller's buffers lent (read straight into them) or not (bounce + copy)."""
    return request.param


@pytest.fixture
def tier(tmp_path):
    t = open_tier(tmp_path)
    yield t
    t.close()


def test_capabilities_and_namespace_in_path(tier, tmp_path) -> None:
    caps = tier.capabilities
    assert (caps.shared, caps.complete_index, caps.local_budget, caps.evicts_itself) == (True, False, False, True)
    items = chain(2)
    assert write_all(tier, items) == [True, True]
    path = tier.layout.path_of(items[0][0].key)
    h = items[0][0].key.hex()
    assert path == f"{tmp_path}/{NS.short_id()}/chunks/{h[:2]}/{h[2:4]}/{h}.kvc"
    assert os.path.exists(path)
    assert (tmp_path / NS.short_id() / "namespace.json").exists()


def test_write_then_prefix_and_read_verified(tier, lent) -> None:
    items = chain(5)
    assert all(write_all(tier, items[:3]))
    keys = [m.key for m, _ in items]
    assert tier.longest_prefix(keys, Deadline.after(5)) == PrefixResult(3, Status.MISS)
    assert tier.longest_prefix(keys[:3], Deadline.after(5)).status is Status.HIT
    outs = bufs(items[:3], extra=7)
    res = tier.read_into(keys[:3], outs, Deadline.after(5), lent=lent)
    assert [r.status for r in res] == [Status.HIT] * 3
    for (m, p), o, r in zip(items, outs, res):
        assert r.meta == m and bytes(o[:P]) == p
    assert tier.read_into(keys[3:4], bufs(items[3:4]), Deadline.after(5), lent=lent)[0].status is Status.MISS


def test_duplicate_writes_are_harmless(tier) -> None:
    items = chain(3)
    assert all(write_all(tier, items))
    assert all(write_all(tier, items))            # already there: accepted, same bytes
    assert all(tier.put(m, p) for m, p in items)
    res = tier.read_into([m.key for m, _ in items], bufs(items), Deadline.after(5))
    assert all(r.ok for r in res)
    assert os.listdir(tier.layout.tmp) == []      # no temp file left behind


def test_duplicate_write_never_replaces_the_published_file(tier, tmp_path) -> None:
    """Another machine's duplicate must not swap the inode under readers (on a network mount their
    cached entry would point at a deleted file: a miss for the entry-cache time)."""
    items = chain(2)
    assert all(write_all(tier, items))
    path = tier.layout.path_of(items[1][0].key)
    before = os.stat(path).st_ino
    other = open_tier(tmp_path)
    try:
        assert all(write_all(other, items))
    finally:
        other.close()
    assert os.stat(path).st_ino == before
    assert os.listdir(tier.layout.tmp) == []


def test_release_called_once_and_copy_when_no_release(tier) -> None:
    items = chain(2)
    released = []
    buf = bytearray(items[1][1])
    tier.write([WriteItem(items[0][0], memoryview(items[0][1]), lambda: released.append(1)),
                WriteItem(items[1][0], memoryview(buf))])
    buf[:] = bytes(len(buf))                      # no release: the tier copied before returning
    assert tier.flush(10)
    assert released == [1]
    out = bufs(items[1:])
    assert tier.read_into([items[1][0].key], out, Deadline.after(5))[0].ok
    assert bytes(out[0]) == items[1][1]


def _writer_proc(path: str, seed: int, rounds: int) -> None:
    t = open_tier(Path(path))
    try:
        for _ in range(rounds):
            write_all(t, chain(8, seed=seed))
            for m, p in chain(8, seed=seed):
                t.put(m, p)
    finally:
        t.close()


def test_concurrent_writers_threads_and_processes_same_chunks(tmp_path) -> None:
    """Two processes and four threads write the same chunks at once; readers always see either
    nothing or the exact bytes, and every chunk ends readable."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer_proc, args=(str(tmp_path), 1, 3)) for _ in range(2)]
    for p in procs:
        p.start()
    tier = open_tier(tmp_path)
    items = chain(8, seed=1)
    bad: list[str] = []

    def reader() -> None:
        for _ in range(30):
            outs = bufs(items)
            for (m, p), o, r in zip(items, outs, tier.read_into([m.key for m, _ in items], outs, Deadline.after(5))):
                if r.ok and bytes(o) != p:
                    bad.append(m.key.hex())
                elif not r.ok and r.status is not Status.MISS:
                    bad.append(f"{r}")

    threads = [threading.Thread(target=lambda: write_all(tier, items)) for _ in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert bad == []
    res = tier.read_into([m.key for m, _ in items], bufs(items), Deadline.after(5))
    assert all(r.ok for r in res)
    assert tier._tm.snapshot().get("events.torn", 0) == 0
    tier.close()


@pytest.mark.parametrize("damage", ["truncate", "torn_tail", "flip", "empty"])
def test_damaged_file_is_counted_miss(tier, damage, monkeypatch, lent) -> None:
    items = chain(2)
    assert all(write_all(tier, items))
    path = tier.layout.path_of(items[1][0].key)
    size = os.path.getsize(path)
    if damage == "truncate":
        os.truncate(path, size - 1000)
    elif damage == "torn_tail":
        os.truncate(path, size - 10)
    elif damage == "empty":
        os.truncate(path, 0)
    else:
        with open(path, "r+b") as f:
            f.seek(5000)
            b = f.read(1)
            f.seek(5000)
            f.write(bytes([b[0] ^ 0xFF]))
    keys = [m.key for m, _ in items]
    res = tier.read_into(keys, bufs(items), Deadline.after(5), lent=lent)
    assert res[0].ok and res[1].status is Status.MISS
    kind = "corrupt" if damage == "flip" else "torn"
    assert tier._tm.snapshot().get(f"events.{kind}", 0) == 1
    if damage == "empty":   # a zero-length file is not even a plausible chunk for the lookup
        assert tier.longest_prefix(keys, Deadline.after(5)).num_chunks == 1
    assert os.path.exists(path)                   # just renamed into place: maybe a write landing
    monkeypatch.setattr(sharedfs, "BAD_GRACE_S", 0.0)
    assert tier.read_into(keys, bufs(items), Deadline.after(5), lent=lent)[1].status is Status.MISS
    assert not os.path.exists(path)               # in place a while: removed, no longer claimed
    assert tier.longest_prefix(keys, Deadline.after(5)).num_chunks == 1


def test_deleted_between_lookup_and_read(tier, lent) -> None:
    items = chain(3)
    assert all(write_all(tier, items))
    keys = [m.key for m, _ in items]
    assert tier.longest_prefix(keys, Deadline.after(5)).num_chunks == 3
    os.unlink(tier.layout.path_of(keys[2]))      # "the other machine" evicted it
    res = tier.read_into(keys, bufs(items), Deadline.after(5), lent=lent)
    assert [r.status for r in res] == [Status.HIT, Status.HIT, Status.MISS]
    assert res[2].error == "missing"
    assert tier._tm.snapshot()["events.missing"] == 1


def test_other_namespace_file_is_a_miss(tier, tmp_path, lent) -> None:
    items = chain(1)
    assert all(write_all(tier, items))
    other = chain(1, seed=9)
    # a file of another chunk copied under this key's name (wrong key), same namespace
    src = tier.layout.path_of(items[0][0].key)
    dst = tier.layout.path_of(other[0][0].key)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read())
    r = tier.read_into([other[0][0].key], bufs(other), Deadline.after(5), lent=lent)[0]
    assert r.status is Status.MISS and r.error == "wrong_key"


def test_buffer_too_small_is_a_counted_miss(tier, lent) -> None:
    """What another machine wrote never raises out of the tier (tests/unit/test_security_alloc.py)."""
    items = chain(1)
    assert all(write_all(tier, items))
    r = tier.read_into([items[0][0].key], [memoryview(bytearray(P - 1))], Deadline.after(5), lent=lent)[0]
    assert r.status is Status.MISS and r.error == "wrong_size"


def test_slow_filesystem_lookup_and_read_honour_deadline(tier, monkeypatch) -> None:
    """A stat/read that blocks (a stalled FUSE mount) makes the call return UNAVAILABLE at its
    deadline; a read finishing late never writes into the caller's buffer."""
    items = chain(4)
    assert all(write_all(tier, items))
    keys = [m.key for m, _ in items]
    gate = threading.Event()
    real_stat, real_read = sharedfs_io.stat_chunk, sharedfs_io.read_chunk

    def slow_stat(path):
        if path.endswith(keys[2].hex() + ".kvc"):
            gate.wait(30)
        return real_stat(path)

    def slow_read(path, limit, ns, key):
        if key == keys[1]:
            gate.wait(30)
        return real_read(path, limit, ns, key)

    monkeypatch.setattr(sharedfs_io, "stat_chunk", slow_stat)
    monkeypatch.setattr(sharedfs_io, "read_chunk", slow_read)
    t0 = time.monotonic()
    r = tier.longest_prefix(keys, Deadline.after(2.0))
    assert (r.num_chunks, r.status) == (2, Status.UNAVAILABLE)
    outs = bufs(items)
    res = tier.read_into(keys, outs, Deadline.after(2.0))
    assert time.monotonic() - t0 < 20                  # returned at the deadlines, not at the gate
    assert res[1].status is Status.UNAVAILABLE and res[1].error == "timeout"
    assert [r.ok for r in res] == [True, False, True, True], res
    gate.set()
    tier._reads.submit(lambda: None)
    deadline = time.monotonic() + 10
    while tier._reads.backlog() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bytes(outs[1]) == bytes(P)                  # the late read left the buffer alone
    assert tier._tm.snapshot()["events.timeout"] >= 2


def test_lent_read_reads_straight_into_the_buffer_and_honours_the_deadline(tier, monkeypatch) -> None:
    """Lent buffers: no bounce copy (the payload is read into the caller's buffer), and a stalled
    read still returns UNAVAILABLE("timeout") at the deadline; what it writes later is the caller's
    to ignore (a lent buffer that did not come back HIT is never reused)."""
    items = chain(3)
    assert all(write_all(tier, items))
    keys = [m.key for m, _ in items]
    copies: list[int] = []
    monkeypatch.setattr(sharedfs, "copy_bytes", lambda dst, src: copies.append(len(dst)))
    gate = threading.Event()
    real = sharedfs_io.read_chunk_into

    def slow_read_into(path, out, ns, key):
        if key == keys[2]:
            gate.wait(30)
        return real(path, out, ns, key)

    monkeypatch.setattr(sharedfs_io, "read_chunk_into", slow_read_into)
    outs = bufs(items)
    t0 = time.monotonic()
    res = tier.read_into(keys, outs, Deadline.after(2.0), lent=True)
    assert time.monotonic() - t0 < 20
    assert [r.status for r in res] == [Status.HIT, Status.HIT, Status.UNAVAILABLE]
    assert res[2].error == "timeout"
    assert [bytes(o[:P]) for o in outs[:2]] == [p for _, p in items[:2]]
    assert copies == []                                 # nothing went through a bounce buffer
    gate.set()


def test_missing_mount_starts_down_and_resumes(tmp_path) -> None:
    base = tmp_path / "mnt"
    tm = Telemetry()
    t = open_tier(base, tm)
    try:
        items = chain(2)
        keys = [m.key for m, _ in items]
        assert t.state == "down"
        assert t.longest_prefix(keys, Deadline.after(1)).status is Status.UNAVAILABLE
        assert t.read_into(keys, bufs(items), Deadline.after(1))[0].status is Status.UNAVAILABLE
        assert write_all(t, items) == [False, False]
        assert not base.exists()                        # never created under a missing mount
        base.mkdir()                                    # the mount is back
        deadline = time.monotonic() + 10
        while t.state != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.state == "ok"
        assert all(write_all(t, items))
        assert t.longest_prefix(keys, Deadline.after(5)).status is Status.HIT
        assert tm.snapshot()["events.shared_down"] >= 2
    finally:
        t.close()


def _refuse(*_a, **_k):
    raise OSError(errno.EROFS, "Read-only file system")


@pytest.mark.parametrize("how", ["chmod", "erofs"])
def test_read_only_mount_serves_reads_drops_writes(tmp_path, monkeypatch, how) -> None:
    t = open_tier(tmp_path)
    items = chain(3)
    assert all(write_all(t, items[:2]))
    t.close()
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root ignores directory permissions (the erofs case covers it)")
        os.chmod(tmp_path / NS.short_id() / "tmp", 0o555)
    else:   # what a read-only mount answers (the JuiceFS test mounts one for real)
        monkeypatch.setattr(sharedfs_io, "probe_write", _refuse)
        monkeypatch.setattr(sharedfs_io, "write_chunk", _refuse)
    tm = Telemetry()
    t = open_tier(tmp_path, tm)
    try:
        assert t.state == "read_only"
        keys = [m.key for m, _ in items]
        assert t.longest_prefix(keys, Deadline.after(5)).num_chunks == 2
        assert all(r.ok for r in t.read_into(keys[:2], bufs(items[:2]), Deadline.after(5)))
        assert write_all(t, items[2:]) == [False]
        assert tm.snapshot()["events.read_only"] >= 2
        monkeypatch.undo()
        os.chmod(tmp_path / NS.short_id() / "tmp", 0o755)
        deadline = time.monotonic() + 10
        while t.state != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.state == "ok" and all(write_all(t, items[2:]))     # writable again: resumes
    finally:
        t.close()
        os.chmod(tmp_path / NS.short_id() / "tmp", 0o755)


def test_burst_events_counted_each_logged_once(tmp_path, caplog) -> None:
    t = open_tier(tmp_path / "absent")
    try:
        items = chain(1)
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvtier.store"):
            for _ in range(20):
                t.write([WriteItem(items[0][0], memoryview(items[0][1]))])
        assert t._tm.snapshot()["events.shared_down"] >= 20
        assert sum("shared_down" in r.getMessage() for r in caplog.records) <= 1
    finally:
        t.close()


def test_write_stamps_keep_chain_tail_oldest(tier) -> None:
    items = chain(6)
    assert all(write_all(tier, items[:3]))
    assert all(write_all(tier, items[3:]))          # second batch continues the chain
    stamps = [os.stat(tier.layout.path_of(m.key)).st_mtime_ns for m, _ in items]
    assert stamps == sorted(stamps, reverse=True)   # head newest, tail oldest
    assert len(set(stamps)) == 6


def test_hit_refreshes_stale_stamps_head_newest(tmp_path) -> None:
    t = open_tier(tmp_path, touch_interval_s=0)
    try:
        items = chain(4)
        assert all(write_all(t, items))
        old = time.time_ns() - 10**12
        for m, _ in items:
            os.utime(t.layout.path_of(m.key), ns=(old, old))
        keys = [m.key for m, _ in items]
        assert all(r.ok for r in t.read_into(keys, bufs(items), Deadline.after(5)))
        assert t.flush(5)
        deadline = time.monotonic() + 5
        while os.stat(t.layout.path_of(keys[0])).st_mtime_ns == old and time.monotonic() < deadline:
            time.sleep(0.02)
        stamps = [os.stat(t.layout.path_of(k)).st_mtime_ns for k in keys]
        assert stamps[0] > old and stamps == sorted(stamps, reverse=True)
    finally:
        t.close()


def test_shared_budget_over_overfill_drops_writes(tmp_path) -> None:
    t = open_tier(tmp_path, capacity=3 * (P + 4116), overfill=1.0)
    try:
        items = chain(8)
        assert all(write_all(t, items[:6]))
        t.janitor = None                                  # a janitor that cannot keep up
        from kvtier.tiers.sharedfs.janitor import Janitor
        j = Janitor(t.layout, t.cfg.model_copy(update={"capacity": 10**12}), t.events, 2)
        j.run_pass()                                      # publishes the count (6 files) without evicting
        t._refresh_usage()
        assert t.usage().num_chunks == 6
        assert write_all(t, items[6:]) == [False, False]
        assert t._tm.snapshot()["events.shared_full"] >= 2
        keys = [m.key for m, _ in items]
        assert t.longest_prefix(keys, Deadline.after(5)).num_chunks == 6     # reads go on
    finally:
        t.close()
