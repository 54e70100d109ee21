"""A Mooncake put whose transfer fails on the way (``TRANSFER_FAIL``: the master revokes the space) is retried
once; a second failure is a counted fault and the chunk is not stored (a cache write is best effort)."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.chunk import ChunkMeta
from kvtier.config import MooncakeConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.mooncake.client import TRANSFER_FAIL
from kvtier.tiers.mooncake.tier import MooncakeTier
from kvtier.tiers.protocol import WriteItem

NS = Namespace("m", "f", "float32", "lbhnc", 16, 32)


class FlakyStore:
    """``batch_put_from_multi_buffers`` answering ``TRANSFER_FAIL`` for the names in ``fail`` (each up to
    ``times`` times), 0 otherwise; records every call's names."""

    def __init__(self, fail: set[int], times: int) -> None:
        self.fail, self.times, self.calls, self.failed = fail, times, [], {}

    def batch_put_from_multi_buffers(self, names, ptrs, sizes, replicate):
        self.calls.append(list(names))
        out = []
        for name in names:
            idx = self.index[name]
            if idx in self.fail and self.failed.get(idx, 0) < self.times:
                self.failed[idx] = self.failed.get(idx, 0) + 1
                out.append(TRANSFER_FAIL)
            else:
                out.append(0)
        return out


def _write(store: FlakyStore) -> tuple[list[bool], Telemetry]:
    tm = Telemetry()
    tier = MooncakeTier(MooncakeConfig(), NS, tm, SimpleNamespace(store=store, replicate=None))
    keys = chunk_keys(NS, list(range(96)))
    payloads = [bytes([i]) * 64 for i in range(len(keys))]
    items = [WriteItem(ChunkMeta(k, keys[i - 1] if i else None, 32, (64,), "uint8", 64), memoryview(payloads[i]))
             for i, k in enumerate(keys)]
    store.index = {tier._name(k): i for i, k in enumerate(keys)}
    try:
        return tier.write(items), tm
    finally:
        tier._lookups.shutdown(wait=False)


def test_a_transfer_that_fails_once_is_retried_and_stored():
    store = FlakyStore(fail={1}, times=1)
    ok, _ = _write(store)
    assert ok == [True, True, True]
    assert len(store.calls) == 2 and len(store.calls[1]) == 1     # only the failed chunk is put again


def test_a_transfer_that_fails_twice_is_a_miss_not_a_loop():
    store = FlakyStore(fail={0, 2}, times=5)
    ok, _ = _write(store)
    assert ok == [False, True, False] and len(store.calls) == 2  # one retry, then the write is given up
