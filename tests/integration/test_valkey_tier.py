"""ValkeyTier against real servers (tests/services): round trips, verification, limits, secrets."""

from __future__ import annotations

import logging

import pytest

from kvtier.config import ValkeyConfig, load_config
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, Status
from kvtier.tiers.valkey import ValkeyTier
from tests.services.chunks import NS, buffers, chain, items
from tests.services.fixtures import valkey_cluster, valkey_password_server, valkey_server  # noqa: F401
from kvtier.services.valkey_server import ValkeyServer

pytestmark = pytest.mark.integration


def _open(url: str, **kw) -> tuple[ValkeyTier, Telemetry]:
    tm = Telemetry()
    return ValkeyTier.open(ValkeyConfig(url=url, **kw), NS, tm), tm


def _roundtrip(tier: ValkeyTier, n: int = 12) -> None:
    chunks = chain(n)
    assert tier.longest_prefix([m.key for m, _ in chunks], Deadline.after(5)).num_chunks == 0
    done = []
    assert tier.write(items(chunks[:8]), lambda k, ok: done.append(ok)) == [True] * 8
    assert done == [True] * 8
    p = tier.longest_prefix([m.key for m, _ in chunks], Deadline.after(5))
    assert (p.num_chunks, p.status) == (8, Status.MISS)
    outs = buffers(chunks)
    res = tier.read_into([m.key for m, _ in chunks], outs, Deadline.after(5))
    assert [r.status for r in res] == [Status.HIT] * 8 + [Status.MISS] * (n - 8)
    for (m, payload), out, r in zip(chunks[:8], outs, res):
        assert r.meta == m and bytes(out[:m.payload_len]) == payload


def test_standalone_roundtrip(valkey_server: ValkeyServer):
    tier, tm = _open(valkey_server.url)
    assert tier.capabilities.shared and tier.capabilities.max_chunk_bytes == 512 * 2**20
    _roundtrip(tier)
    tier.close()


def test_cluster_roundtrip_spreads_chunks(valkey_cluster):
    tier, tm = _open(valkey_cluster.url, cluster=True)
    _roundtrip(tier, n=24)
    sizes = [n.client().dbsize() for n in valkey_cluster.nodes]
    assert sum(sizes) == 8 and sum(1 for s in sizes if s) >= 2
    tier.close()


def test_corrupt_value_is_a_counted_miss_and_removed(valkey_server: ValkeyServer):
    tier, tm = _open(valkey_server.url)
    chunks = chain(2)
    tier.write(items(chunks))
    c = valkey_server.client()
    rk = tier._rk(chunks[1][0].key)
    blob = bytearray(c.get(rk))
    blob[5000] ^= 0xFF
    c.set(rk, bytes(blob))
    res = tier.read_into([m.key for m, _ in chunks], buffers(chunks), Deadline.after(5))
    assert [r.status for r in res] == [Status.HIT, Status.MISS] and res[1].error == "corrupt"
    assert tm.counts["events.corrupt"] == 1 and c.exists(rk) == 0
    # a value stored under another chunk's key (wrong key) is refused too
    c.set(tier._rk(chunks[1][0].key), c.get(tier._rk(chunks[0][0].key)))
    assert tier.read_into([chunks[1][0].key], buffers(chunks[1:]), Deadline.after(5))[0].error == "wrong_key"


def test_ttl_expires_chunks(valkey_server: ValkeyServer):
    tier, _ = _open(valkey_server.url, ttl_s=30)
    chunks = chain(1)
    tier.write(items(chunks))
    ttl_ms = valkey_server.client().pttl(tier._rk(chunks[0][0].key))
    assert 0 < ttl_ms <= 30_000


def test_chunk_over_proto_max_bulk_len_is_refused(tmp_path):
    srv = ValkeyServer.start(tmp_path, extra=["--proto-max-bulk-len", "1mb"])
    try:
        tier, tm = _open(srv.url)
        assert tier.capabilities.max_chunk_bytes == 2**20
        big = chain(1, payload_len=2**20)
        assert tier.write(items(big)) == [False]
        assert tm.counts["events.too_large"] == 1
        assert tier.write(items(chain(1, payload_len=2**19, seed=1))) == [True]
    finally:
        srv.stop()


def test_password_from_env_never_shown(valkey_password_server: ValkeyServer, caplog):
    secret = valkey_password_server.password
    env = {"KVTIER_STORE__SHARED__KIND": "valkey",
           "KVTIER_STORE__SHARED__URL": f"redis://127.0.0.1:{valkey_password_server.port}/0",
           "KVTIER_STORE__SHARED__PASSWORD": secret}
    cfg = load_config(env=env).store.shared
    assert isinstance(cfg, ValkeyConfig) and secret not in repr(cfg) and secret not in str(cfg.model_dump_json())
    with caplog.at_level(logging.DEBUG):
        tier = ValkeyTier.open(cfg, NS, Telemetry())
        _roundtrip(tier, n=9)
    assert secret not in caplog.text
    # credentials in the url are moved out of it
    cfg2 = ValkeyConfig(url=valkey_password_server.url)
    assert secret not in cfg2.url and secret not in repr(cfg2)
    assert ValkeyTier.open(cfg2, NS, Telemetry()).write(items(chain(1, seed=3))) == [True]


def test_another_deployment_never_reads_these_chunks(valkey_server: ValkeyServer):
    """``store.deployment`` on a shared Valkey: equal chunk keys, another deployment -> no hit, no bytes."""
    from dataclasses import replace

    mine, _ = _open(valkey_server.url)
    theirs = ValkeyTier.open(ValkeyConfig(url=valkey_server.url), replace(NS, deployment="other-team"), Telemetry())
    try:
        chunks = chain(3)
        keys = [m.key for m, _ in chunks]
        assert mine.write(items(chunks)) == [True] * 3
        assert theirs.longest_prefix(keys, Deadline.after(5)).num_chunks == 0
        assert {r.status for r in theirs.read_into(keys, buffers(chunks), Deadline.after(5))} == {Status.MISS}
        # even a value copied under their key name is refused: its header names the other namespace
        c = valkey_server.client()
        c.set(theirs._rk(keys[0]), c.get(mine._rk(keys[0])))
        assert theirs.read_into(keys[:1], buffers(chunks[:1]), Deadline.after(5))[0].error == "namespace_mismatch"
    finally:
        mine.close()
        theirs.close()
