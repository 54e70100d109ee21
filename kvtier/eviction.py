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

Contract of ``pick``: the leaf of least priority (``lru``: logical time of the last
put/read, unique; ``cost``: ties broken by the order the leaf became a candidate) that
``exclude`` does not reject.

Data structures. ``cost``: candidates sit in a heap with lazy invalidation (touching
pushes a fresh entry, stale entries are skipped when popped, the heap is rebuilt when it
grows past four times the live entries): O(log n) amortised. ``lru``: every put/read
gives a new, largest time, so the leaves live in an ``OrderedDict`` kept in time order
(append / ``move_to_end``, O(1), no stale entries); the one exception — a parent that
becomes a leaf again keeps its older time — goes to a small side heap unless it is newer
than the last leaf of the dict, and ``pick`` merges the two. Typical pick, put and read
are O(1); ``tests/unit/test_eviction_exact.py`` holds both policies to a reference
implementation (a plain heap over all leaves) on random operation sequences.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Literal

from kvtier.keys import ChunkKey

PolicyName = Literal["lru", "cost"]
_END = object()


@dataclass(slots=True)
class _Entry:
    parent: ChunkKey | None
    size: int
    tokens: int
    depth: int
    hits: int = 1
    stamp: int = 0          # cost: seq of the heap item that is current for this entry
    prio: float = 0.0


class EvictionPolicy:
    """Tracks one tier's chunks and picks prefix-aware victims.

    ``contains(key)``, ``has_children(key)`` (does any chunk in this tier name ``key`` as its
    parent? lock-free: one dict lookup) and ``count()`` (= ``len``) are bound dict methods, no
    Python frame: the simulator calls them millions of times."""

    def __init__(self, name: PolicyName = "lru") -> None:
        if name not in ("lru", "cost"):
            raise ValueError(f"unknown eviction policy {name!r}")
        self.name = name
        self._lru = name == "lru"
        self._entries: dict[ChunkKey, _Entry] = {}
        self._kids: dict[ChunkKey, set[ChunkKey]] = {}     # a key is here only while it has children
        self._heap: list[tuple] = []      # cost: (prio, stamp, key), lazy; lru: (prio, key) of _old leaves
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()   # lru: leaves, oldest first
        self._old: dict[ChunkKey, float] = {}                      # lru: leaves kept in _heap instead
        self._seq = itertools.count()
        self._clock = 0.0   # lru: logical time; cost: GDSF inflation value L
        self.contains: Callable[[object], bool] = self._entries.__contains__
        self.has_children: Callable[[object], bool] = self._kids.__contains__
        self.count: Callable[[], int] = self._entries.__len__

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

    def is_leaf(self, key: ChunkKey) -> bool:
        return key not in self._kids

    # -- candidate bookkeeping ------------------------------------------------------------

    def _cost_push(self, key: ChunkKey, e: _Entry) -> None:
        e.prio = self._clock + e.hits * (e.tokens * (1.0 + e.depth * e.tokens / 4096.0)) / max(e.size, 1)
        e.stamp = next(self._seq)
        heapq.heappush(self._heap, (e.prio, e.stamp, key))
        if len(self._heap) > 4 * len(self._entries) + 64:
            self._heap = [(e.prio, e.stamp, k) for k, e in self._entries.items() if k not in self._kids]
            heapq.heapify(self._heap)

    def _unleaf(self, key: ChunkKey) -> None:
        """lru: ``key`` got its first child (or left): no longer a candidate."""
        if self._order.pop(key, _END) is _END:
            self._old.pop(key, None)

    def _releaf(self, key: ChunkKey, e: _Entry) -> None:
        """A present chunk lost its last child: a candidate again, with its own priority."""
        if not self._lru:
            e.stamp = next(self._seq)
            heapq.heappush(self._heap, (e.prio, e.stamp, key))
            return
        # (a releafed parent is older than the dict's last leaf but for rare cases; the side heap
        # is right for any leaf, ``pick`` merges the two, so no comparison is made)
        self._old[key] = e.prio
        heapq.heappush(self._heap, (e.prio, key))
        if len(self._heap) > 4 * len(self._old) + 64:
            self._heap = [(p, k) for k, p in self._old.items()]
            heapq.heapify(self._heap)

    # -- operations -------------------------------------------------------------------------

    def add(self, key: ChunkKey, parent: ChunkKey | None, size: int, tokens: int = 1) -> None:
        """Record a new chunk (or refresh an existing one, counting a hit)."""
        entries = self._entries
        if key in entries:
            self.touch(key)
            return
        pe = entries.get(parent) if parent is not None else None
        e = _Entry(parent, size, tokens, pe.depth + 1 if pe else 0)
        entries[key] = e
        if parent is not None:
            kids = self._kids.get(parent)
            if kids is None:
                self._kids[parent] = {key}
                if pe is not None and self._lru:
                    self._unleaf(parent)
            else:
                kids.add(key)
        if self._lru:
            self._clock += 1.0
            e.prio = self._clock
            if key not in self._kids:     # (children may have arrived first)
                self._order[key] = None
        else:
            self._cost_push(key, e)

    def put_evicting(self, key: ChunkKey, parent: ChunkKey | None, size: int, tokens: int, capacity: int,
                     exclude: Callable[[ChunkKey], bool] | None = None) -> tuple[bool, int]:
        """A bounded tier's put in one call: a present ``key`` is touched; otherwise victims
        (``pick(exclude)``, then ``remove``) leave until fewer than ``capacity`` chunks remain,
        then ``key`` is added. Returns (present or added, victims removed); (False, n) when no
        victim was left. Exactly those calls in that order (``test_eviction_exact.py``)."""
        entries = self._entries
        if key in entries:
            self.touch(key)
            return True, 0
        n = 0
        if not self._lru:
            while len(entries) >= capacity:
                v = self._pick_cost(exclude)
                if v is None:
                    return False, n
                self.remove(v)
                n += 1
            self.add(key, parent, size, tokens)
            return True, n
        order, heap, old, kids = self._order, self._heap, self._old, self._kids
        while len(entries) >= capacity:
            # pick, inlined: the older of the dict's first leaf and the side heap's top
            while heap and old.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)
            v = next(iter(order), None)
            if heap and (v is None or heap[0][0] < entries[v].prio):
                v = heap[0][1]
            if v is None:
                return False, n
            if exclude is not None and exclude(v):
                v = self.pick(exclude)
                if v is None:
                    return False, n
            e = entries.pop(v)                           # remove, inlined
            if order.pop(v, _END) is _END:
                del old[v]
                if heap and heap[0][1] == v:             # (the usual case: drop its heap item now)
                    heapq.heappop(heap)
            vp = e.parent
            if vp is not None:
                pk = kids.get(vp)
                if pk is not None:
                    pk.discard(v)
                    if not pk:
                        del kids[vp]
                        pe = entries.get(vp)
                        if pe is not None:
                            self._releaf(vp, pe)
                            heap = self._heap                # (_releaf may have rebuilt it)
            n += 1
        # add, inlined
        pe = entries.get(parent) if parent is not None else None
        e = _Entry(parent, size, tokens, pe.depth + 1 if pe else 0)
        entries[key] = e
        if parent is not None:
            pk = kids.get(parent)
            if pk is None:
                kids[parent] = {key}
                if pe is not None and order.pop(parent, _END) is _END:
                    old.pop(parent, None)
            else:
                pk.add(key)
        self._clock += 1.0
        e.prio = self._clock
        if key not in kids:
            order[key] = None
        return True, n

    def set_parent(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """Fill in a parent learned later (a chunk discovered without its header)."""
        e = self._entries.get(key)
        if e is None or e.parent == parent or parent is None:
            return
        if e.parent is not None:
            self._drop_edge(e.parent, key)
        e.parent = parent
        kids = self._kids.get(parent)
        if kids is None:
            self._kids[parent] = {key}
            if self._lru and parent in self._entries:
                self._unleaf(parent)
        else:
            kids.add(key)

    def touch(self, key: ChunkKey) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.hits += 1
        if not self._lru:
            self._cost_push(key, e)
            return
        self._clock += 1.0
        e.prio = self._clock
        order = self._order
        if key in order:
            order.move_to_end(key)
        elif self._old.pop(key, _END) is not _END:
            order[key] = None

    def _drop_edge(self, parent: ChunkKey, key: ChunkKey) -> None:
        kids = self._kids.get(parent)
        if kids is None:
            return
        kids.discard(key)
        if not kids:
            del self._kids[parent]
            pe = self._entries.get(parent)
            if pe is not None:        # the parent just became a leaf: a candidate again
                self._releaf(parent, pe)

    def remove(self, key: ChunkKey) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        if self._lru and self._order.pop(key, _END) is _END:
            self._old.pop(key, None)
        parent = e.parent
        if parent is not None:          # (_drop_edge, inlined: the simulator's hottest path)
            kids = self._kids.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._kids[parent]
                    pe = self._entries.get(parent)
                    if pe is not None:
                        self._releaf(parent, pe)

    def pick(self, exclude: Callable[[ChunkKey], bool] | None = None) -> ChunkKey | None:
        """The next victim (a leaf), or None when no candidate is left. Does not remove it."""
        if not self._lru:
            return self._pick_cost(exclude)
        heap, old = self._heap, self._old
        while heap and old.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)                       # stale: touched, re-parented or removed
        if not heap:                                  # the common case: the dict alone, oldest first
            if exclude is None:
                return next(iter(self._order), None)
            for k in self._order:
                if not exclude(k):
                    return k
            return None
        entries = self._entries
        it = iter(self._order)
        a = next(it, _END)
        popped: list[tuple] = []
        victim = None
        while True:
            while heap and old.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)
            if heap and (a is _END or heap[0][0] < entries[a].prio):
                item = heapq.heappop(heap)
                popped.append(item)
                k = item[1]
            elif a is not _END:
                k = a
                a = next(it, _END)
            else:
                break
            if exclude is None or not exclude(k):
                victim = k
                break
        for item in popped:
            heapq.heappush(heap, item)
        return victim

    def _pick_cost(self, exclude: Callable[[ChunkKey], bool] | None) -> ChunkKey | None:
        skipped: list[tuple] = []
        victim = None
        heap, entries, kids = self._heap, self._entries, self._kids
        while heap:
            item = heapq.heappop(heap)
            prio, stamp, key = item
            e = entries.get(key)
            if e is None or e.stamp != stamp or key in kids:
                continue
            if exclude is not None and exclude(key):
                skipped.append(item)
                continue
            victim = key
            heapq.heappush(heap, item)   # stays current until remove()
            self._clock = max(self._clock, prio)
            break
        for item in skipped:
            heapq.heappush(heap, item)
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
