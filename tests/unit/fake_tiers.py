"""Test-only tiers: an in-process stand-in for a shared backend that can be stalled or failed.

``DictSharedTier`` implements the batched protocol natively (as a network tier would) and
declares itself shared (no complete local index, evicts by itself). ``stall()`` makes every
call block until ``resume()`` (like a SIGSTOPped server or a paused FUSE mount);
``fail = True`` makes calls raise ConnectionError (like a refused connection).
"""

from __future__ import annotations

import threading
from typing import Sequence

from kvtier.chunk import ChunkMeta
from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier, TierUsage, as_byte_view
from kvtier.tiers.protocol import Capabilities, Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem


class DictSharedTier(Tier):
    name = "shared"
    capabilities = Capabilities(shared=True, evicts_itself=True, complete_index=False, local_budget=False)

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[ChunkKey, tuple[ChunkMeta, bytes]] = {}
        self.lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self.fail = False
        self.calls = 0
        self.blocked = 0           # calls blocked in a stall right now
        self.max_blocked = 0

    # -- fault controls ----------------------------------------------------------------------
    def stall(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def _enter(self) -> None:
        with self.lock:
            self.calls += 1
            self.blocked += 1
            self.max_blocked = max(self.max_blocked, self.blocked)
        try:
            self._running.wait()
        finally:
            with self.lock:
                self.blocked -= 1
        if self.fail:
            raise ConnectionError("backend down")

    # -- batched protocol (native) -------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        self._enter()
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return PrefixResult(n, Status.HIT if n == len(keys) else Status.MISS)

    def read_into(self, keys, outs, deadline: Deadline, *, lent: bool = False) -> list[ReadResult]:
        self._enter()
        res = []
        for k, o in zip(keys, outs):
            got = self.data.get(k)
            if got is None:
                res.append(ReadResult.miss())
                continue
            out = as_byte_view(o, writable=True)
            if len(out) < len(got[1]):
                raise ValueError("buffer too small")
            out[:len(got[1])] = got[1]
            res.append(ReadResult.hit(got[0]))
        return res

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        try:
            self._enter()
            for it in items:
                self.data[it.meta.key] = (it.meta, bytes(it.payload))
        finally:
            for it in items:
                if it.release is not None:
                    it.release()
        if on_done is not None:
            for it in items:
                on_done(it.meta.key, True)
        return [True] * len(items)

    # -- per-key legacy methods ------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.longest_prefix([key], Deadline.never()).num_chunks == 1

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        return self.read_into([key], [out], Deadline.never())[0].meta

    def get(self, key: ChunkKey):
        self._enter()
        got = self.data.get(key)
        return None if got is None else (got[0], memoryview(bytearray(got[1])))

    def put(self, meta: ChunkMeta, payload) -> bool:
        return self.write([WriteItem(meta, as_byte_view(payload))])[0]

    def delete(self, key: ChunkKey) -> bool:
        return self.data.pop(key, None) is not None

    def usage(self) -> TierUsage:
        return TierUsage(sum(len(p) for _, p in self.data.values()), 1 << 40, len(self.data))

    def keys(self) -> list[ChunkKey]:
        return list(self.data)

    def children(self, key: ChunkKey) -> list[ChunkKey]:
        return []

    def holds(self, key: ChunkKey) -> bool:
        return False

    def has_children(self, key: ChunkKey) -> bool:
        return False
