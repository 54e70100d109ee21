"""The shared-fs tier as the store builds it (registry -> GuardedTier) on a stalled JuiceFS mount:
bounded waits, the breaker opens (no new I/O, counted once per burst), the probe closes it once
the mount answers again, and the store's local tiers serve throughout."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.store import TieredStore
from kvtier.tiers.protocol import Deadline, Status
from tests.services.fixtures import juicefs  # noqa: F401
from kvtier.services.juicefs import JuiceFs
from tests.unit.sharedfs_helpers import NS, P, chain, open_tier, write_all

pytestmark = pytest.mark.integration


def _until(check, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_stalled_mount_through_the_guarded_store_tier(juicefs: JuiceFs, tmp_path, caplog) -> None:
    a, b = juicefs.mount("a"), juicefs.mount("b")
    (a.path / "kv").mkdir()
    assert _until(lambda: (b.path / "kv").is_dir())
    cfg = load_config(overrides={"store": {
        "chunk_size": NS.chunk_size, "memory": {"capacity": "64MiB"},
        "disk": {"enabled": True, "path": str(tmp_path / "ssd")},
        "shared": {"kind": "sharedfs", "path": str(a.path / "kv"), "lookup_timeout_s": 0.5,
                   "io_timeout_s": 1.0, "probe_interval_s": 0.2, "max_inflight": 4}}}).store
    store = TieredStore.open(cfg, NS)
    other = open_tier(b.path / "kv")
    try:
        shared = store.tier("sharedfs")
        assert type(shared).__name__ == "GuardedTier"
        remote = chain(6, seed=1)                           # written by "the other machine"
        assert all(write_all(other, remote))
        rkeys = [m.key for m, _ in remote]
        assert _until(lambda: store.shared_prefix(rkeys, Deadline.after(2)).status is Status.HIT)
        local = chain(3, seed=2)                            # this machine's own chunks (RAM + SSD)
        for i, (m, p) in enumerate(local):
            assert store.put(m.key, m.parent, p, num_tokens=m.num_tokens, shape=m.shape, dtype=m.dtype)
        a.pause()
        try:
            time.sleep(1.5)                                 # kernel attribute cache expires
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvtier.store"):
                for _ in range(8):
                    t0 = time.monotonic()
                    r = store.shared_prefix(rkeys, Deadline.after(0.5))
                    outs = [bytearray(P) for _ in rkeys]
                    res = store.read_into(rkeys, outs, Deadline.after(1.0))
                    assert time.monotonic() - t0 < 5          # bounded by the deadlines
                    assert r.status is Status.UNAVAILABLE or r.num_chunks == 6
                    for (m, p), o, rr in zip(remote, outs, res):
                        assert not rr.ok or bytes(o) == p     # never wrong bytes
                    out = bytearray(P)                        # local tiers keep serving
                    assert store.get_into(local[0][0].key, out) == P and bytes(out) == local[0][1]
            assert shared.breaker.is_open
            snap = store.stats()["counters"]
            assert sum(v for k, v in snap.items() if k.startswith("events.")) >= 1
            assert sum("unavailable" in r.getMessage() or "timeout" in r.getMessage()
                       for r in caplog.records) <= 3          # once per burst, not per call
        finally:
            a.resume()
        assert _until(lambda: not shared.breaker.is_open)    # the probe saw the mount answer
        outs = [bytearray(P) for _ in rkeys]
        assert _until(lambda: all(r.ok for r in store.read_into(rkeys, outs, Deadline.after(10))))
        assert [bytes(o) for o in outs] == [p for _, p in remote]
    finally:
        a.resume()
        store.close()
        other.close()
