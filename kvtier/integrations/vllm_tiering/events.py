"""``TierEvents``: this tier's stores and evictions as vLLM ``OffloadingEvent``s (``take_events``).

Stored: the keys of every store job that succeeded (as vLLM's ``fs`` tier reports them). Removed:
chunks kvtier's local tiers evicted (the SSD tier's byte budget), by their ``OffloadKey``s, when
the store has no shared tier; with a shared tier an SSD eviction does not take a chunk out of this
tier (the shared tier may still hold it), and the shared tier's own evictions (janitor, server
policy) are not seen by any one process, so none are reported. Events are collected only when they
are on (the tier's ``enable_kv_events`` and vLLM's KV events); thread-safe (evictions are reported
from kvtier's writer threads).
"""

from __future__ import annotations

import threading
from typing import Collection

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent

from kvtier.integrations.vllm_tiering.keymap import KeyMap
from kvtier.store import StoreEvent


class TierEvents:
    def __init__(self, enabled: bool, medium: Medium, locality: Locality | None, keymap: KeyMap,
                 report_evictions: bool) -> None:
        self.enabled = enabled
        self._medium = medium
        self._locality = locality
        self._keymap = keymap
        self._report_evictions = report_evictions
        self._events: list[OffloadingEvent] = []
        self._lock = threading.Lock()

    def stored(self, keys: Collection[bytes]) -> None:
        if self.enabled and keys:
            self._add(list(keys), removed=False)

    def on_store_event(self, event: StoreEvent) -> None:
        """kvtier store listener: local evictions become removal events."""
        if not (self.enabled and self._report_evictions and event.kind == "evicted"):
            return
        keys = self._keymap.offload_keys(event.keys)
        if keys:
            self._add(keys, removed=True)

    def _add(self, keys: list, removed: bool) -> None:
        ev = OffloadingEvent(keys=keys, medium=self._medium, removed=removed, locality=self._locality)
        with self._lock:
            self._events.append(ev)

    def take(self) -> list[OffloadingEvent]:
        """Every event since the last call, oldest first."""
        with self._lock:
            out, self._events = self._events, []
        return out
