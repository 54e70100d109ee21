"""Chunk lineage across the tiers: whether a chunk is present anywhere, and what has to go when a
chunk leaves every tier.

Every chunk but the first of a prompt names its parent. A chunk is *present* when a local tier
holds it or a shared tier is known to (``mark_shared``: the keys a shared tier answered or was
written, the most recent ``SHARED_SEEN_MAX`` of them). The rules ``TieredStore`` keeps with it:
a put whose parent is not present is refused; a local tier does not evict the last copy of a
chunk whose children live in another local tier (``evict_guard``); when a chunk leaves every
tier, its descendants are removed from the local tiers (``cascade``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

from kvtier.keys import ChunkKey
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier

SHARED_SEEN_MAX = 65536     # keys known to be in a shared tier (parents of local puts)

#: ``notify(kind, tier, keys)``: how a removal is announced (``Listeners.notify``)
Notify = Callable[[str, Tier, Sequence[ChunkKey]], None]


class Lineage:
    """Presence and descendants of chunks over the local tiers ``local`` (thread-safe)."""

    def __init__(self, local: Sequence[Tier], telemetry: Telemetry, notify: Notify) -> None:
        self.local = local          # the store's own list
        self._tm = telemetry
        self._notify = notify
        self._shared_seen: OrderedDict[ChunkKey, None] = OrderedDict()
        self._seen_lock = threading.Lock()

    def present(self, key: ChunkKey) -> bool:
        """A local tier holds ``key``, or a shared tier is known to."""
        if any(t.contains(key) for t in self.local):
            return True
        return key in self._shared_seen

    def mark_shared(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` are in a shared tier (answered by it, or written to it)."""
        if not keys:
            return
        with self._seen_lock:
            for k in keys:
                self._shared_seen[k] = None
                self._shared_seen.move_to_end(k)
            while len(self._shared_seen) > SHARED_SEEN_MAX:
                self._shared_seen.popitem(last=False)

    def forget_shared(self, key: ChunkKey) -> None:
        """``key`` was deleted: no longer known to be in a shared tier."""
        with self._seen_lock:
            self._shared_seen.pop(key, None)

    @staticmethod
    def evict_guard(others: list[Tier]) -> Callable[[ChunkKey], bool]:
        """For a local tier whose fellow local tiers are ``others``: True for the last copy of a
        chunk whose children live elsewhere (that tier keeps it)."""
        def keep(key: ChunkKey) -> bool:
            return not any(t.holds(key) for t in others) and any(t.has_children(key) for t in others)
        return keep

    def cascade(self, keys: list[ChunkKey]) -> None:
        """Remove, from every local tier, the descendants of each of ``keys`` that no tier holds.

        Walks parent->child edges tier by tier, so a chain that crosses tiers (a RAM chunk
        whose parent lives only on disk) is followed too. Shared tiers keep their own chains."""
        work = [k for k in keys if not self.present(k)]
        seen = set(work)
        while work:
            key = work.pop()
            children: set[ChunkKey] = set()
            for tier in self.local:
                for child in tier.children(key):
                    children.add(child)
                    if tier.delete(child):
                        self._tm.event("orphan_evicted", tier.name, child.hex()[:16])
                        self._notify("evicted", tier, [child])
            for child in children - seen:
                seen.add(child)
                work.append(child)
