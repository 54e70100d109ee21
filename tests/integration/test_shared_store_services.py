"""The tiered store over [memory, shared] with real Valkey and Mooncake backends (no vLLM):
machine A's store writes through to the shared tier, machine B's store (its own empty RAM) finds
the prefix there and reads verified bytes; a dead backend is a miss for B, never an exception."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.config import StoreConfig
from kvtier.keys import Namespace
from kvtier.store import TieredStore
from kvtier.tiers.protocol import Deadline, Status
from tests.services.fixtures import mooncake, valkey_cluster, valkey_server  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NS = Namespace("m", "f", "float32", "store-services", 16, 16)


def _store(shared: dict) -> TieredStore:
    cfg = StoreConfig.model_validate({"chunk_size": 16, "memory": {"capacity": "64MiB"},
                                      "shared": {**shared, "io_timeout_s": 2.0, "probe_interval_s": 0.2}})
    return TieredStore.open(cfg, NS)


def _chain(n: int, size: int = 96 * 1024):
    rng = np.random.default_rng(7)
    keys = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(n)]
    return keys, [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def _a_then_b(shared: dict, kill=None) -> None:
    keys, payloads = _chain(6)
    a = _store(shared)
    try:
        parent = None
        for k, p in zip(keys, payloads):
            assert a.put(k, parent, p, num_tokens=16, shape=(len(p) // 4,), dtype="float32")
            parent = k
        assert a.flush(30)
    finally:
        a.close()
    b = _store(shared)
    try:
        assert b.lookup(keys).num_chunks == 0                     # B's own RAM is empty
        pre = b.shared_prefix(keys, Deadline.after(5))
        assert (pre.num_chunks, pre.status) == (6, Status.HIT)
        outs = [bytearray(len(p)) for p in payloads]
        res = b.read_into(keys, outs, Deadline.after(10))
        assert all(r.ok for r in res) and [bytes(o) for o in outs] == payloads
        if kill is not None:
            kill()
            assert b.shared_prefix(keys[::-1], Deadline.after(5)).status is not Status.HIT
            res = b.read_into(keys[::-1][:2], [bytearray(len(p)) for p in payloads[:2]], Deadline.after(5))
            assert all(r.status in (Status.HIT, Status.MISS, Status.UNAVAILABLE) for r in res)
    finally:
        b.close()


def test_valkey_store_cross_machine(valkey_server):
    _a_then_b({"kind": "valkey", "url": valkey_server.url}, kill=valkey_server.kill)


def test_valkey_cluster_store_cross_machine(valkey_cluster):
    _a_then_b({"kind": "valkey", "url": valkey_cluster.url, "cluster": True})


def test_mooncake_store_cross_machine(mooncake):
    _a_then_b({"kind": "mooncake", "master": mooncake.master_addr, "metadata_server": mooncake.metadata_url},
              kill=mooncake.kill_master)
