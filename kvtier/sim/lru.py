"""A lean LRU tier for the simulator, held to the store's ``EvictionPolicy("lru")`` order by tests.

Same contract as ``kvtier.eviction`` (prefix-aware, leaves only; the victim is the leaf of
least logical time — the time of its last put or read — that ``exclude`` does not reject) and
the same data structures (leaves in an ``OrderedDict`` in time order, the parents that become
leaves again in a side heap), with less per chunk: an entry is a two-item list ``[parent,
time]`` instead of an object, a parent's children are a count instead of a set (the simulator
never asks which children), and leaves carry their time as the dict value. Only the
operations the simulator's tiers use: ``contains``, ``has_children``, ``touch``,
``put_evicting``, ``pick``, ``keys``.

``tests/unit/test_sim_lru.py`` drives it and ``EvictionPolicy("lru")`` through random
put / touch / guarded-put sequences and asserts the same results and contents after every
step; ``tests/unit/test_sim_store_model.py`` holds the whole store model (which uses this class
for LRU tiers) to a reference built on ``EvictionPolicy``. Not thread-safe; one simulation.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

_END = object()


class LeanLRU:
    name = "lru"

    def __init__(self) -> None:
        self._ent: dict[int, list] = {}                 # key -> [parent, time]
        self._kids: dict[int, int] = {}                 # key -> children present (only while > 0)
        self._order: OrderedDict[int, int] = OrderedDict()   # leaves, oldest first: key -> time
        self._old: dict[int, int] = {}                  # leaves kept in the side heap: key -> time
        self._heap: list[tuple[int, int]] = []          # (time, key) of _old, lazily cleaned
        self._clock = 0
        self.contains: Callable[[object], bool] = self._ent.__contains__
        self.has_children: Callable[[object], bool] = self._kids.__contains__
        self.count: Callable[[], int] = self._ent.__len__

    def __len__(self) -> int:
        return len(self._ent)

    def __contains__(self, key: object) -> bool:
        return key in self._ent

    def keys(self) -> list[int]:
        return list(self._ent)

    def touch(self, key: int) -> None:
        e = self._ent.get(key)
        if e is None:
            return
        self._clock += 1
        e[1] = c = self._clock
        order = self._order
        if key in order:
            order.move_to_end(key)
            order[key] = c
        elif self._old.pop(key, _END) is not _END:
            order[key] = c

    def pick(self, exclude: Callable[[int], bool] | None = None) -> int | None:
        """The next victim (a leaf), or None; does not remove it."""
        heap, old, order = self._heap, self._old, self._order
        while heap and old.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            for k in order:
                if exclude is None or not exclude(k):
                    return k
            return None
        it = iter(order.items())
        a = next(it, None)
        popped: list[tuple[int, int]] = []
        victim = None
        while True:
            while heap and old.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)
            if heap and (a is None or heap[0][0] < a[1]):
                item = heapq.heappop(heap)
                popped.append(item)
                k = item[1]
            elif a is not None:
                k = a[0]
                a = next(it, None)
            else:
                break
            if exclude is None or not exclude(k):
                victim = k
                break
        for item in popped:
            heapq.heappush(heap, item)
        return victim

    def put_evicting(self, key: int, parent: int | None, size: int, tokens: int, capacity: int,
                     exclude: Callable[[int], bool] | None = None) -> tuple[bool, int]:
        """``EvictionPolicy.put_evicting``: a present key is touched; otherwise victims leave
        until fewer than ``capacity`` chunks remain, then the key is added. (present or added,
        victims removed); (False, n) when no victim was left. ``size``/``tokens`` are unused
        (LRU)."""
        ent = self._ent
        if key in ent:
            self.touch(key)
            return True, 0
        n = 0
        order, heap, old, kids = self._order, self._heap, self._old, self._kids
        while len(ent) >= capacity:
            while heap and old.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)
            v = next(iter(order), None)
            if heap and (v is None or heap[0][0] < order[v]):
                v = heap[0][1]
            if v is None:
                return False, n
            if exclude is not None and exclude(v):
                v = self.pick(exclude)
                if v is None:
                    return False, n
            vp = ent.pop(v)[0]
            if order.pop(v, _END) is _END:
                del old[v]
                if heap and heap[0][1] == v:
                    heapq.heappop(heap)
            if vp is not None:
                c = kids.get(vp)
                if c is not None:
                    if c == 1:
                        del kids[vp]
                        pe = ent.get(vp)
                        if pe is not None:               # the parent is a leaf again
                            t = pe[1]
                            f = next(iter(order), None)
                            if f is None or t < order[f]:
                                # older than every leaf in time order (the usual case: a
                                # chain's tail was the victim, its parent was used before
                                # it): the front of the order keeps it sorted
                                order[vp] = t
                                order.move_to_end(vp, last=False)
                            else:                        # otherwise the side heap
                                old[vp] = t
                                heapq.heappush(heap, (t, vp))
                                if len(heap) > 4 * len(old) + 64:
                                    self._heap = heap = [(t, k) for k, t in old.items()]
                                    heapq.heapify(heap)
                    else:
                        kids[vp] = c - 1
            n += 1
        self._clock += 1
        c = self._clock
        ent[key] = [parent, c]
        if parent is not None:
            k = kids.get(parent)
            if k is None:
                kids[parent] = 1
                if parent in ent and order.pop(parent, _END) is _END:
                    old.pop(parent, None)
            else:
                kids[parent] = k + 1
        if key not in kids:
            order[key] = c
        return True, n
