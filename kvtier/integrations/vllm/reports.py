"""What the worker tells the scheduler about its tiers: keys stored / promoted / evicted.

``TierReports.on_event`` is subscribed to the store (``store.subscribe``) and may be called
from any thread (puts, disk writers, the promoter, RAM evictions). ``take()`` hands back, once
per step, the keys that entered the worker's local tiers (with the top local tier now holding
each) and the keys that left **every** local tier. A key evicted from one tier but still held
by another (RAM eviction of a chunk also on SSD, a write-back demotion) is reported as stored
in that other tier, not as evicted. Side-effect free apart from its own state.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class TierReports:
    def __init__(self, where: Callable[[Any], str | None]) -> None:
        self._where = where
        self._lock = threading.Lock()
        self._stored: dict[bytes, str] = {}       # key -> top local tier, since the last take()
        self._evicted: dict[bytes, None] = {}

    def on_event(self, event: Any) -> None:
        """(any thread) A ``kvtier.store.StoreEvent``."""
        with self._lock:
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
