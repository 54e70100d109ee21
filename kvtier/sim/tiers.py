"""kvtier's tiers as the simulator models them: capacity, speed, and the store's own eviction code.

Each ``TierModel`` keeps its chunks in a real ``kvtier.eviction.EvictionPolicy`` (the
store's code, not a copy: prefix-aware, leaves only, LRU or cost), so the simulator evicts
in exactly the store's order. ``StoreModel`` mirrors ``TieredStore``: lookup = longest
prefix held by some tier (RAM, then SSD, then shared); a read touches the chunk in the
tier that served it and counts it toward promotion into RAM (at the ``promote_min_hits``-th
read from a lower tier, off the critical path); a save is write-through to every tier; a
tier never evicts the last copy of a chunk whose children live in another tier (so the store's
cascade — a chunk that left every tier takes its descendants — never has work here).
Read time per tier touched: ``op_latency_s + chunks * (chunk_latency_s + chunk_bytes / read_bw)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.eviction import EvictionPolicy, PolicyName
from kvtier.sim.lru import LeanLRU
from kvtier.sim.profile import TierProfile

TIER_NAMES = ("ram", "ssd", "shared")


@dataclass
class TierModel:
    name: str
    capacity_chunks: int
    speed: TierProfile
    chunk_bytes: int
    chunk_tokens: int
    policy: EvictionPolicy | LeanLRU
    evictions: int = 0

    @classmethod
    def open(cls, name: str, speed: TierProfile, chunk_bytes: int, chunk_tokens: int,
             policy: PolicyName) -> "TierModel":
        return cls(name, int(speed.capacity // max(chunk_bytes, 1)), speed, chunk_bytes, chunk_tokens,
                   LeanLRU() if policy == "lru" else EvictionPolicy(policy))

    def __contains__(self, key: int) -> bool:
        return key in self.policy

    def read_time(self, n: int) -> float:
        s = self.speed
        return s.op_latency_s + n * (s.chunk_latency_s + self.chunk_bytes / s.read_bw) if n else 0.0


@dataclass
class StoreModel:
    tiers: list[TierModel]
    promote_min_hits: int = 2
    _lower_hits: dict[int, int] = field(default_factory=dict)
    promotions: int = 0
    _guard_cache: list = field(default_factory=list)
    _parent: list = field(default_factory=lambda: [None])   # the parent of the chunk being put
    _bound: tuple = ()            # per-tier bound methods, rebuilt when tiers were added (a cluster's shared tier)

    @classmethod
    def open(cls, speeds: dict[str, TierProfile], chunk_bytes: int, chunk_tokens: int, policy: PolicyName,
             promote_min_hits: int) -> "StoreModel":
        tiers = [TierModel.open(n, speeds[n], chunk_bytes, chunk_tokens, policy) for n in TIER_NAMES
                 if speeds[n].capacity >= chunk_bytes]
        return cls(tiers, promote_min_hits)

    def _methods(self) -> tuple:
        """(tier count, contains per tier, [(tier index, put_evicting, size, tokens, capacity,
        guard)] of the tiers with room, touch per tier, (op latency, per-chunk read time) per
        tier); cached until the tier list changes."""
        b = self._bound
        if not b or b[0] != len(self.tiers):
            guards = self._guards()
            live = tuple((i, t.policy.put_evicting, t.chunk_bytes, t.chunk_tokens, t.capacity_chunks, g)
                         for i, (t, g) in enumerate(zip(self.tiers, guards)) if t.capacity_chunks > 0)
            cost = tuple((t.speed.op_latency_s, t.speed.chunk_latency_s + t.chunk_bytes / t.speed.read_bw)
                         for t in self.tiers)         # read_time's terms, same arithmetic
            b = self._bound = (len(self.tiers), tuple(t.policy.contains for t in self.tiers), live,
                               tuple(t.policy.touch for t in self.tiers), cost)
        return b

    def present(self, key: int) -> bool:
        for h in self._methods()[1]:
            if h(key):
                return True
        return False

    def lookup(self, keys: list[int]) -> list[int]:
        """Tier index serving each chunk of the longest available prefix."""
        has = self._methods()[1]
        if len(has) == 1:
            h0 = has[0]
            n = 0
            for k in keys:
                if not h0(k):
                    break
                n += 1
            return [0] * n
        if len(has) == 2:
            h0, h1 = has
            out: list[int] = []
            for k in keys:
                if h0(k):
                    out.append(0)
                elif h1(k):
                    out.append(1)
                else:
                    break
            return out
        out = []
        for k in keys:
            for i, h in enumerate(has):
                if h(k):
                    out.append(i)
                    break
            else:
                break
        return out

    def read(self, keys: list[int], where: list[int]) -> float:
        """Load ``keys`` from the tiers ``where`` names; returns the synchronous load time."""
        tiers = self.tiers
        counts = [0] * len(tiers)
        ram = tiers[0] if tiers and tiers[0].name == "ram" else None
        b = self._methods()
        touch = b[3]
        lower = self._lower_hits
        for j, (k, i) in enumerate(zip(keys, where)):
            counts[i] += 1
            touch[i](k)
            if ram is not None and i > 0:
                c = lower.get(k, 0) + 1
                if c >= self.promote_min_hits:
                    lower.pop(k, None)
                    parent = keys[j - 1] if j else None
                    if parent is None or ram.policy.contains(parent):
                        self._put(0, k, parent)
                        self.promotions += 1
                else:
                    lower[k] = c
        total = 0                               # (= sum(t.read_time(n) ...), term by term)
        for (op, per), n in zip(b[4], counts):
            if n:
                total += op + n * per
        return total

    def load(self, keys: list[int], where: list[int]) -> tuple[float, list[int]]:
        """A claim's load: (time, the tier serving each chunk). Every claimed chunk loads here
        (the scheduler sees the tiers as they are); ``kvtier.sim.ram_view`` overrides it."""
        return self.read(keys, where), where

    def save(self, keys: list[int], start: int) -> None:
        """Write-through of chunks ``keys[start:]`` (``keys`` = the prompt's whole chain): per
        chunk, one ``put_evicting`` per tier, tier after tier (the store's order)."""
        if start >= len(keys):
            return
        parent = keys[start - 1] if start else None
        _, has, live, _, _ = self._methods()
        if parent is not None:
            for h in has:
                if h(parent):
                    break
            else:
                return                         # orphan put: refused, like TieredStore.put
        if not live:
            return
        cell = self._parent
        ev = [0] * len(self.tiers)
        if len(live) == 1:
            (i, put, size, tokens, cap, keep), = live
            for j in range(start, len(keys)):
                key = keys[j]
                cell[0] = parent
                ok, n = put(key, parent, size, tokens, cap, keep)
                ev[i] += n
                if not ok:
                    break                      # the rest would be orphans
                parent = key
        elif len(live) == 2:                   # the same, RAM + SSD unrolled
            (i0, put0, size0, tok0, cap0, keep0), (i1, put1, size1, tok1, cap1, keep1) = live
            e0 = e1 = 0
            for j in range(start, len(keys)):
                key = keys[j]
                cell[0] = parent
                ok0, n0 = put0(key, parent, size0, tok0, cap0, keep0)
                ok1, n1 = put1(key, parent, size1, tok1, cap1, keep1)
                e0 += n0
                e1 += n1
                if not (ok0 or ok1):
                    break                      # the rest would be orphans
                parent = key
            ev[i0], ev[i1] = e0, e1
        else:
            for j in range(start, len(keys)):
                key = keys[j]
                cell[0] = parent
                stored = False
                for i, put, size, tokens, cap, keep in live:
                    ok, n = put(key, parent, size, tokens, cap, keep)
                    if n:
                        ev[i] += n
                    if ok:
                        stored = True
                if not stored:
                    break                      # the rest would be orphans
                parent = key
        for t, n in zip(self.tiers, ev):
            if n:
                t.evictions += n

    def _guards(self) -> list:
        """Per tier, the store's eviction guard for the chunk being put (its parent in
        ``self._parent``): never the new chunk's parent, nor the last copy of a chunk whose
        children live in another tier. Rebuilt when tiers were added (a cluster's shared tier)."""
        cache = self._guard_cache
        if len(cache) != len(self.tiers):
            cache.clear()
            for t in self.tiers:
                pols = [o.policy for o in self.tiers if o is not t]
                cache.append(self._guard([p.contains for p in pols], [p.has_children for p in pols]))
        return cache

    def _guard(self, contains: list, kids: list):
        cell = self._parent
        if not kids:
            def keep0(k: int) -> bool:
                return k == cell[0]
            return keep0
        if len(kids) == 1:
            okids, ocont = kids[0], contains[0]

            def keep1(k: int) -> bool:
                return k == cell[0] or (okids(k) and not ocont(k))
            return keep1

        def keep(k: int) -> bool:
            if k == cell[0]:
                return True
            for h in kids:
                if h(k):
                    for c in contains:
                        if c(k):
                            return False
                    return True
            return False
        return keep

    def _put(self, i: int, key: int, parent: int | None) -> bool:
        tier = self.tiers[i]
        if tier.capacity_chunks <= 0:
            return False
        self._parent[0] = parent
        ok, n = tier.policy.put_evicting(key, parent, tier.chunk_bytes, tier.chunk_tokens, tier.capacity_chunks,
                                         self._guards()[i])
        # (Lineage.cascade — descendants of a chunk that left every tier — has nothing to do
        # here: a victim is a leaf in its tier and the guard refuses one with children in another
        # tier unless it has a copy there.)
        tier.evictions += n
        return ok
