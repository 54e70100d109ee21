"""Prefix-aware eviction policies (one tier's bookkeeping; not thread-safe: tiers lock).

A chunk key names a whole prefix, so a chunk is only useful while its parent is
reachable. Both policies therefore only ever pick *leaves*: chunks with no child
present in the same tier. Chain tails go first; a parent becomes a candidate once
its last child has left. Among leaves:

``lru``  least recently put/read first.
``cost`` GreedyDual-Size-Frequency: priority = L + hits * cost / size, where cost
         estimates the prefill work saved by the chunk (its tokens, weighted by
         depth in the chain because attention over a longer prefix costs more:
         ``tokens * (1 + depth * tokens / 4096)``), and L is the priority of the last
         victim (ageing, so once-hot chunks eventually leave). Cheap-to-recompute,
         rarely-hit, large chunks go first.

Candidates sit in a heap with lazy invalidation: touching pushes a fresh entry,
stale entries are skipped when popped, and the heap is rebuilt when it grows past
four times the live entries, so every operation is O(log n) amortised.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Literal

from kvtier.keys import ChunkKey

PolicyName = Literal["lru", "cost"]


@dataclass(slots=True)
class _Entry:
    parent: ChunkKey | None
    size: int
    tokens: int
    depth: int
    hits: int = 1
    stamp: int = 0          # seq of the heap item that is current for this entry
    prio: float = 0.0


class EvictionPolicy:
    """Tracks one tier's chunks and picks prefix-aware victims."""

    def __init__(self, name: PolicyName = "lru") -> None:
        if name not in ("lru", "cost"):
            raise ValueError(f"unknown eviction policy {name!r}")
        self.name = name
        self._entries: dict[ChunkKey, _Entry] = {}
        self._kids: dict[ChunkKey, set[ChunkKey]] = {}
        self._heap: list[tuple[float, int, ChunkKey]] = []
        self._seq = itertools.count()
        self._clock = 0.0   # lru: logical time; cost: GDSF inflation value L

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[ChunkKey]:
        return list(self._entries)

    def parent(self, key: ChunkKey) -> ChunkKey | None:
        e = self._entries.get(key)
        return e.parent if e else None

    def children(self, key: ChunkKey) -> set[ChunkKey]:
        """Children of ``key`` present in this tier."""
        return set(self._kids.get(key, ()))

    def has_children(self, key: ChunkKey) -> bool:
        """Lock-free read (one dict lookup): does any chunk in this tier name ``key`` as parent?"""
        return bool(self._kids.get(key))

    def is_leaf(self, key: ChunkKey) -> bool:
        return not self._kids.get(key)

    def _priority(self, e: _Entry) -> float:
        if self.name == "lru":
            self._clock += 1.0
            return self._clock
        cost = e.tokens * (1.0 + e.depth * e.tokens / 4096.0)
        return self._clock + e.hits * cost / max(e.size, 1)

    def _push(self, key: ChunkKey, e: _Entry) -> None:
        e.prio = self._priority(e)
        e.stamp = next(self._seq)
        heapq.heappush(self._heap, (e.prio, e.stamp, key))
        if len(self._heap) > 4 * len(self._entries) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(e.prio, e.stamp, k) for k, e in self._entries.items() if self.is_leaf(k)]
        heapq.heapify(self._heap)

    def add(self, key: ChunkKey, parent: ChunkKey | None, size: int, tokens: int = 1) -> None:
        """Record a new chunk (or refresh an existing one, counting a hit)."""
        if key in self._entries:
            self.touch(key)
            return
        pe = self._entries.get(parent) if parent is not None else None
        e = _Entry(parent, size, tokens, pe.depth + 1 if pe else 0)
        self._entries[key] = e
        if parent is not None:
            self._kids.setdefault(parent, set()).add(key)
        self._push(key, e)

    def set_parent(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """Fill in a parent learned later (a chunk discovered without its header)."""
        e = self._entries.get(key)
        if e is None or e.parent == parent or parent is None:
            return
        if e.parent is not None:
            self._drop_edge(e.parent, key)
        e.parent = parent
        self._kids.setdefault(parent, set()).add(key)

    def touch(self, key: ChunkKey) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.hits += 1
        self._push(key, e)

    def _drop_edge(self, parent: ChunkKey, key: ChunkKey) -> None:
        kids = self._kids.get(parent)
        if kids is None:
            return
        kids.discard(key)
        if not kids:
            del self._kids[parent]
            pe = self._entries.get(parent)
            if pe is not None:        # the parent just became a leaf: a candidate again
                pe.stamp = next(self._seq)
                heapq.heappush(self._heap, (pe.prio, pe.stamp, parent))

    def remove(self, key: ChunkKey) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        if e.parent is not None:
            self._drop_edge(e.parent, key)

    def pick(self, exclude: Callable[[ChunkKey], bool] | None = None) -> ChunkKey | None:
        """The next victim (a leaf), or None when no candidate is left. Does not remove it."""
        skipped: list[tuple[float, int, ChunkKey]] = []
        victim = None
        while self._heap:
            item = heapq.heappop(self._heap)
            prio, stamp, key = item
            e = self._entries.get(key)
            if e is None or e.stamp != stamp or not self.is_leaf(key):
                continue
            if exclude is not None and exclude(key):
                skipped.append(item)
                continue
            victim = key
            heapq.heappush(self._heap, item)   # stays current until remove()
            if self.name == "cost":
                self._clock = max(self._clock, prio)
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victim

    def descendants(self, key: ChunkKey) -> list[ChunkKey]:
        """All chunks below ``key`` in this tier, deepest first (safe removal order)."""
        out: list[ChunkKey] = []
        stack = list(self._kids.get(key, ()))
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(self._kids.get(k, ()))
        out.reverse()
        return out

    def orphans(self, present: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        """Chunks whose parent is not ``present`` (anywhere the caller checks)."""
        return [k for k, e in self._entries.items() if e.parent is not None and not present(e.parent)]

