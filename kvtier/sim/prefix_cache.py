"""vLLM's own prefix cache (the first tier), at the granularity of the trace's units.

Modelled on vLLM v1's block pool: a fixed number of blocks; full blocks are cached by
their prefix hash; blocks of running requests are held (reference counted, shared between
requests with a common prefix); a finished request's blocks go to the free queue in
reverse order (its chain tail is evicted first); an allocation takes empty blocks first,
then evicts the least recently freed cached blocks. A request's full blocks become cached
at the end of the step that computed (or loaded) them, so a request admitted one step later
already hits them. Not thread-safe; one engine.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCacheModel:
    def __init__(self, capacity_units: int, enabled: bool = True) -> None:
        self.capacity = max(0, capacity_units)
        self.enabled = enabled
        self._free: OrderedDict[int, None] = OrderedDict()   # cached, evictable; front = next victim
        self._held: dict[int, int] = {}                       # cached, in use: refcount
        self.private = 0                                       # in use, not cached (partial, decode, dup)
        self.evictions = 0

    @property
    def empty(self) -> int:
        return self.capacity - self.private - len(self._held) - len(self._free)

    @property
    def cached_units(self) -> int:
        return len(self._held) + len(self._free)

    def used_by_nobody(self) -> bool:
        """No running request holds a block (an allocation that fails now never fits)."""
        return self.private == 0 and not self._held

    def match(self, units: list[int], limit: int | None = None) -> int:
        """Leading units present (held or free-cached), among the first ``limit`` (all if None)."""
        return self.match_free(units, len(units) if limit is None else limit)[0]

    def match_free(self, units: list[int], limit: int) -> tuple[int, int]:
        """``(match(units, limit), how many of those leading units are free-cached)``: the
        second is what ``fits`` needs (one pass over the units instead of two)."""
        if not self.enabled:
            return 0, 0
        n = nf = 0
        held, free = self._held, self._free
        stop = min(limit, len(units))
        while n < stop:
            h = units[n]
            if h in held:
                n += 1
            elif h in free:
                n += 1
                nf += 1
            else:
                break
        return n, nf

    def can_allocate(self, hit: list[int], total_units: int) -> bool:
        return self.fits(len(hit), sum(map(self._free.__contains__, hit)), total_units)

    def fits(self, hit: int, hit_free: int, total_units: int) -> bool:
        """Room to hold ``hit`` matched units (``hit_free`` of them free-cached) and allocate
        ``total_units - hit`` fresh ones."""
        return (self.capacity - self.private - len(self._held) - hit_free) >= total_units - hit

    def acquire(self, hit: list[int], total_units: int) -> None:
        """Hold the hit units and allocate ``total_units - len(hit)`` fresh ones (call
        ``can_allocate`` first)."""
        held, free = self._held, self._free
        for h in hit:
            if h in held:
                held[h] += 1
            else:
                del free[h]
                held[h] = 1
        need = total_units - len(hit)
        evict = need - (self.capacity - self.private - len(held) - len(free))   # need - empty
        if evict > 0:
            pop = free.popitem
            for _ in range(evict):
                pop(last=False)
            self.evictions += evict
        self.private += need

    def grow(self, n: int = 1) -> bool:
        """A running request needs ``n`` more blocks (decode crossed a block boundary): take
        empty blocks, then evict the least recently freed cached ones; False (nothing taken)
        when the pool has no room — vLLM then preempts."""
        if self.empty + len(self._free) < n:
            return False
        take_empty = min(n, self.empty)
        free = self._free
        for _ in range(n - take_empty):
            free.popitem(last=False)
            self.evictions += 1
        self.private += n
        return True

    def commit(self, new_units: list[int]) -> list[int]:
        """The request computed ``new_units`` (full prompt units past its hit): cache them.
        Returns those now cached under this request (already-cached duplicates stay private)."""
        if not self.enabled:
            return []
        held, free = self._held, self._free
        out = []
        for h in new_units:
            if h not in held and h not in free:
                held[h] = 1
                out.append(h)
        self.private -= len(out)
        return out

    def release(self, cached_units: list[int], private_units: int) -> None:
        """A request finished: its cached units (hit + committed, prompt order) become free
        when no other request holds them (tail first in the queue); its private units empty."""
        held, free = self._held, self._free
        for h in reversed(cached_units):
            c = held[h] - 1
            if c:
                held[h] = c
            else:
                del held[h]
                free[h] = None
        self.private -= private_units
