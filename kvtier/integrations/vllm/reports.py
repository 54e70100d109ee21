"""What the worker tells the scheduler about its tiers: keys stored / promoted / evicted.

``TierReports.on_event`` is subscribed to the store (``store.subscribe``) and may be called
from any thread (puts, disk writers, the promoter, RAM evictions). ``take()`` hands back, once
per step, the keys that entered the worker's local tiers (with the top local tier now holding
each) and the keys that left **every** local tier. A key evicted from one tier but still held
by another (RAM eviction of a chunk also on SSD, a write-back demotion) is reported as stored
in that other tier, not as evicted. Side-effect free apart from its own state.

With ``track_changes`` (KV events enabled) it also keeps every tier's entries and exits, in
order (``take_changes``: ``TierChange`` per key and tier, at most ``MAX_CHANGES`` per step; more
are dropped and counted in ``dropped_changes``), and ``shared_stored`` adds the keys whose save
was accepted by a shared tier (the store does not announce shared tiers' changes).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from kvtier.integrations.vllm.metadata import TierChange

#: The most tier changes kept between two ``take_changes`` (one engine step).
MAX_CHANGES = 65536


class TierReports:
    def __init__(self, where: Callable[[Any], str | None], track_changes: bool = False) -> None:
        self._where = where
        self._lock = threading.Lock()
        self._stored: dict[bytes, str] = {}       # key -> top local tier, since the last take()
        self._evicted: dict[bytes, None] = {}
        self.track_changes = track_changes
        self._changes: list[TierChange] = []
        self.dropped_changes = 0

    def _note(self, kind: str, tier: str, keys: Sequence[Any]) -> None:
        """(lock held) Keep ``keys``' change of ``tier`` for ``take_changes``."""
        for k in keys:
            if len(self._changes) >= MAX_CHANGES:
                self.dropped_changes += 1
                continue
            self._changes.append(TierChange(kind, tier, bytes(k)))

    def on_event(self, event: Any) -> None:
        """(any thread) A ``kvtier.store.StoreEvent``."""
        with self._lock:
            if self.track_changes:
                self._note("removed" if event.kind == "evicted" else "stored", event.tier, event.keys)
            for k in event.keys:
                k = bytes(k)
                where = self._where(k)
                if event.kind in ("stored", "promoted"):
                    self._evicted.pop(k, None)
                    self._stored[k] = where or event.tier
                elif where is None:
                    self._stored.pop(k, None)
                    self._evicted[k] = None
                else:                              # left one tier, still in another: it moved
                    self._stored[k] = where

    def take(self) -> tuple[dict[bytes, str], list[bytes]]:
        """(stored key -> tier, evicted keys) since the last call."""
        with self._lock:
            stored, self._stored = self._stored, {}
            evicted, self._evicted = self._evicted, {}
        return stored, list(evicted)

    def shared_stored(self, keys: Sequence[Any]) -> None:
        """(any thread) A shared tier accepted the writes of ``keys`` (kept only with ``track_changes``)."""
        if self.track_changes and keys:
            with self._lock:
                self._note("stored", "shared", keys)

    def take_changes(self) -> list[TierChange]:
        """Every tier's entries and exits since the last call, in order."""
        with self._lock:
            out, self._changes = self._changes, []
        return out
