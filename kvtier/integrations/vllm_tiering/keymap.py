"""``KeyMap``: vLLM ``OffloadKey`` -> kvtier ``ChunkKey`` for one namespace, and back for events.

The forward map is a pure function (``chunk_key``); the way back (which ``OffloadKey`` did an
evicted chunk hold) is remembered for the last ``capacity`` keys this tier stored (``stored_key``;
lookups of keys never stored do not push them out), so KV events for evictions name vLLM's keys.
A chunk evicted after its key fell out of that window is reported to nobody (a router then learns
of its absence at the next miss). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

from kvtier.integrations.vllm_tiering.namespace import offload_chunk_key
from kvtier.keys import ChunkKey, Namespace

DEFAULT_CAPACITY = 1 << 18       # keys remembered for events (~60 MiB at most)


class KeyMap:
    def __init__(self, namespace: Namespace, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"KeyMap capacity must be >= 1, got {capacity}")
        self.namespace = namespace
        self._capacity = capacity
        self._back: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def chunk_key(self, offload_key: bytes) -> ChunkKey:
        """The kvtier key of ``offload_key`` (pure)."""
        return offload_chunk_key(self.namespace, offload_key)

    def stored_key(self, offload_key: bytes) -> ChunkKey:
        """The kvtier key of ``offload_key``, remembered for the way back (a store)."""
        ck = offload_chunk_key(self.namespace, offload_key)
        with self._lock:
            self._back[ck] = offload_key
            self._back.move_to_end(ck)
            if len(self._back) > self._capacity:
                self._back.popitem(last=False)
        return ck

    def chunk_keys(self, offload_keys: Iterable[bytes]) -> list[ChunkKey]:
        return [self.chunk_key(k) for k in offload_keys]

    def offload_keys(self, chunk_keys: Iterable[ChunkKey]) -> list[bytes]:
        """The remembered ``OffloadKey`` of each chunk key (unknown ones are left out)."""
        with self._lock:
            return [k for k in (self._back.get(ck) for ck in chunk_keys) if k is not None]

    def __len__(self) -> int:
        return len(self._back)
