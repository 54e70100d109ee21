"""ValkeyTier failure drills with real servers: each ends in a miss / unavailable / False plus a
counted event, never an exception, never wrong bytes, and the tier recovers by itself."""

from __future__ import annotations

import logging
import time

import pytest

from kvtier.config import ValkeyConfig
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, Status
from kvtier.tiers.valkey import ValkeyTier
from kvtier.ports import free_port
from tests.services.chunks import NS, buffers, chain, items
from tests.services.fixtures import started, valkey_cluster, valkey_server, valkey_small_server  # noqa: F401
from kvtier.services.valkey_server import ValkeyServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _tier(url: str, **kw) -> tuple[ValkeyTier, Telemetry]:
    tm = Telemetry()
    cfg = ValkeyConfig(url=url, lookup_timeout_s=0.3, io_timeout_s=0.5, probe_interval_s=0.1, **kw)
    return ValkeyTier.open(cfg, NS, tm), tm


def _keys(chunks):
    return [m.key for m, _ in chunks]


def _assert_right_bytes(chunks, outs, res):
    for (m, payload), out, r in zip(chunks, outs, res):
        if r.ok:
            assert bytes(out[:m.payload_len]) == payload


def test_server_absent_at_start_then_appears(tmp_path):
    port = free_port()
    tier, tm = _tier(f"redis://127.0.0.1:{port}/0")
    chunks = chain(4)
    assert tier.longest_prefix(_keys(chunks), Deadline.after(5)).status is Status.UNAVAILABLE
    assert {r.status for r in tier.read_into(_keys(chunks), buffers(chunks), Deadline.after(5))} == {Status.UNAVAILABLE}
    assert tier.write(items(chunks)) == [False] * 4
    assert tm.counts["events.down"] >= 1
    srv = started(lambda: ValkeyServer.start(tmp_path, port=port))
    try:
        assert tier.write(items(chunks)) == [True] * 4
        assert tier.longest_prefix(_keys(chunks), Deadline.after(5)).num_chunks == 4
    finally:
        srv.stop()


def test_killed_mid_run_and_restarted(valkey_server: ValkeyServer):
    tier, tm = _tier(valkey_server.url)
    chunks = chain(6)
    assert tier.write(items(chunks)) == [True] * 6
    valkey_server.kill()
    assert tier.longest_prefix(_keys(chunks), Deadline.after(5)).status is Status.UNAVAILABLE
    res = tier.read_into(_keys(chunks), buffers(chunks), Deadline.after(5))
    assert {r.status for r in res} == {Status.UNAVAILABLE}
    assert tm.counts["events.down"] >= 1
    valkey_server.restart()  # empty: no persistence
    p = tier.longest_prefix(_keys(chunks), Deadline.after(5))
    assert (p.num_chunks, p.status) == (0, Status.MISS)
    assert tier.write(items(chunks)) == [True] * 6
    outs = buffers(chunks)
    res = tier.read_into(_keys(chunks), outs, Deadline.after(5))
    assert all(r.ok for r in res)
    _assert_right_bytes(chunks, outs, res)


def test_paused_server_times_out_instead_of_hanging(valkey_server: ValkeyServer):
    tier, tm = _tier(valkey_server.url)
    chunks = chain(4)
    tier.write(items(chunks))
    valkey_server.pause()
    try:
        assert tier.longest_prefix(_keys(chunks), Deadline.after(5)).status is Status.UNAVAILABLE
        res = tier.read_into(_keys(chunks), buffers(chunks), Deadline.after(5))
        assert {r.status for r in res} == {Status.UNAVAILABLE}
        assert tier.write(items(chain(2, seed=9))) == [False, False]
        assert tm.counts["events.timeout"] >= 1
    finally:
        valkey_server.resume()
    outs = buffers(chunks)
    res = tier.read_into(_keys(chunks), outs, Deadline.after(5))
    assert all(r.ok for r in res)
    _assert_right_bytes(chunks, outs, res)


def test_full_server_evicts_and_old_chunks_become_counted_misses(valkey_small_server: ValkeyServer):
    tier, tm = _tier(valkey_small_server.url)
    chunks = chain(40, payload_len=512 * 1024)  # 20 MiB into an 8 MiB server
    for i in range(0, 40, 4):
        tier.write(items(chunks[i:i + 4]))
    outs = buffers(chunks)
    res = tier.read_into(_keys(chunks), outs, Deadline.after(10))
    hits = sum(r.ok for r in res)
    assert 0 < hits < 40 and all(r.status in (Status.HIT, Status.MISS) for r in res)
    assert tm.counts["events.missing"] == 40 - hits
    _assert_right_bytes(chunks, outs, res)


def test_full_noeviction_server_rejects_writes_logged_once_per_burst(tmp_path, caplog):
    srv = started(lambda: ValkeyServer.start(tmp_path, maxmemory="4mb", policy="noeviction"))
    try:
        tier, tm = _tier(srv.url)
        oks = []
        with caplog.at_level(logging.WARNING, logger="kvtier.store"):
            for i in range(10):
                oks += tier.write(items(chain(4, payload_len=512 * 1024, seed=i)))
        assert True in oks and False in oks
        assert tm.counts["events.full"] == oks.count(False)          # every rejected chunk counted
        assert sum("kvtier full event" in r.getMessage() for r in caplog.records) == 1   # one burst: logged once
        assert tier._bursts.suppressed["full"] == oks.count(False) - 1
        first = chain(4, payload_len=512 * 1024, seed=0)
        assert tier.longest_prefix(_keys(first), Deadline.after(5)).num_chunks >= 1  # reads go on
    finally:
        srv.stop()


def test_wrong_password_disables_the_tier_with_one_line(tmp_path, caplog):
    srv = started(lambda: ValkeyServer.start(tmp_path, password="right-secret"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            tier, tm = _tier(f"redis://127.0.0.1:{srv.port}/0", password="wrong-secret")
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "refused the credentials" in errors[0].getMessage()
        assert "\n" not in errors[0].getMessage() and "secret" not in caplog.text
        assert tm.counts["events.auth_failed"] == 1
        chunks = chain(2)
        assert tier.longest_prefix(_keys(chunks), Deadline.after(5)).status is Status.UNAVAILABLE
        assert tier.write(items(chunks)) == [False, False]
        assert {r.status for r in tier.read_into(_keys(chunks), buffers(chunks), Deadline.after(5))} == {
            Status.UNAVAILABLE}
    finally:
        srv.stop()


def test_cluster_node_down_fails_only_its_slots(valkey_cluster):
    tier, tm = _tier(valkey_cluster.url, cluster=True)
    chunks = chain(24)
    assert tier.write(items(chunks)) == [True] * 24
    valkey_cluster.node(1).kill()
    outs = buffers(chunks)
    res = tier.read_into(_keys(chunks), outs, Deadline.after(10))
    statuses = [r.status for r in res]
    assert Status.HIT in statuses and Status.UNAVAILABLE in statuses and Status.MISS not in statuses
    _assert_right_bytes(chunks, outs, res)
    assert tm.counts["events.down"] >= 1
    assert tier.longest_prefix(_keys(chunks), Deadline.after(5)).status in (Status.UNAVAILABLE, Status.HIT)
    valkey_cluster.node(1).restart()  # rejoins with its nodes.conf, empty; the cluster heals by gossip
    for _ in range(100):
        res = tier.read_into(_keys(chunks), buffers(chunks), Deadline.after(10))
        if Status.UNAVAILABLE not in {r.status for r in res}:
            break
        time.sleep(0.1)
    assert {r.status for r in res} == {Status.HIT, Status.MISS}  # the tier reconnected by itself
