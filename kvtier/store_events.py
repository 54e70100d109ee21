"""What ``TieredStore`` tells its listeners: one ``StoreEvent`` per change of a local tier.

``Listeners`` holds the subscribers and calls each one from the thread that made the change;
a listener that raises is logged and never breaks the data path. Changes of tiers without a
complete local index (shared tiers) are not announced: other machines change them too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier

log = logging.getLogger("kvtier.store")


@dataclass(frozen=True)
class StoreEvent:
    """What changed in this process's local tiers: ``stored`` (a put was accepted, or a demotion),
    ``promoted`` (copied up from a lower tier), ``evicted`` (left that tier: evicted, deleted,
    failed write, vanished file)."""

    kind: Literal["stored", "promoted", "evicted"]
    tier: str
    keys: tuple[ChunkKey, ...]


StoreListener = Callable[[StoreEvent], None]


class Listeners:
    """The subscribers of one store."""

    def __init__(self) -> None:
        self._listeners: list[StoreListener] = []

    def subscribe(self, listener: StoreListener) -> Callable[[], None]:
        """Add ``listener``; returns a function that removes it again."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def notify(self, kind: str, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        """Call every listener with ``StoreEvent(kind, tier.name, keys)`` when ``tier`` is local."""
        if not keys or not self._listeners or not tier.capabilities.complete_index:
            return
        event = StoreEvent(kind, tier.name, tuple(keys))  # type: ignore[arg-type]
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception as e:  # a listener must never break the data path
                log.warning("kvtier: store listener failed: %s", e)
