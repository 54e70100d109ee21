"""Promotion: a chunk read from tier i is copied into the local tiers above it.

``copy_up`` is the copy itself (on a hit in ``read_into``, or later through ``TieredStore.promote``);
``from_below`` is what the background ``Promoter`` runs per queued key: read the chunk from the first
lower tier holding it and copy it up. Nothing is promoted when ``promote_on_hit`` is off, and a chunk
whose parent is not present anywhere is never promoted (no orphans); when the parent leaves during
the copy, the copy is removed again.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvtier.chunk import ChunkMeta
from kvtier.config import StoreConfig
from kvtier.keys import ChunkKey
from kvtier.lineage import Lineage, Notify
from kvtier.tiers.base import Tier
from kvtier.tiers.protocol import Deadline, WriteItem


class Promotion:
    """Copies up over ``tiers`` (top first) of one store."""

    def __init__(self, config: StoreConfig, tiers: Sequence[Tier], lineage: Lineage, notify: Notify,
                 closed: Callable[[], bool]) -> None:
        self.config = config
        self.tiers = tiers          # the store's own list
        self.lineage = lineage
        self._notify = notify
        self._closed = closed
        #: the largest payload put or prepared so far: the read size when a tier cannot say
        self.max_payload = 0

    def copy_up(self, meta: ChunkMeta, payload: memoryview, from_index: int) -> None:
        """Write the verified chunk into every local tier above ``from_index`` that lacks it."""
        present = self.lineage.present
        if not self.config.promote_on_hit or (meta.parent is not None and not present(meta.parent)):
            return
        for tier in self.tiers[:from_index]:
            if not tier.capabilities.complete_index or tier.contains(meta.key):
                continue
            if tier.write([WriteItem(meta, payload)])[0]:
                if meta.parent is not None and not present(meta.parent):
                    tier.delete(meta.key)      # the parent left meanwhile: never keep an orphan
                    return
                self._notify("promoted", tier, [meta.key])

    def from_below(self, key: ChunkKey, scratch: bytearray) -> bytearray:
        """(promoter thread) Read ``key`` from the first lower tier holding it, copy it up. Returns
        the scratch buffer to use next (``scratch``, or a larger one)."""
        if self._closed() or self.tiers[0].contains(key):
            return scratch
        for ti, tier in enumerate(self.tiers[1:], 1):
            if tier.capabilities.complete_index and not tier.contains(key):
                continue
            need = tier.payload_size(key) or self.max_payload
            if need <= 0:
                continue
            if len(scratch) < need:
                scratch = bytearray(need)
            try:
                res = tier.read_into([key], [memoryview(scratch)], Deadline.never())[0]
            except ValueError:      # replaced by a larger chunk meanwhile: skip it
                return scratch
            if res.ok and res.meta is not None:
                self.copy_up(res.meta, memoryview(scratch)[:res.meta.payload_len], ti)
                return scratch
        return scratch
