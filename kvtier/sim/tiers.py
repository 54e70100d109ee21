"""kvtier's tiers as the simulator models them: capacity, speed, and the store's own eviction code.

Each ``TierModel`` keeps its chunks in a real ``kvtier.eviction.EvictionPolicy`` (the
store's code, not a copy: prefix-aware, leaves only, LRU or cost), so the simulator evicts
in exactly the store's order. ``StoreModel`` mirrors ``TieredStore``: lookup = longest
prefix held by some tier (RAM, then SSD, then shared); a read touches the chunk in the
tier that served it and counts it toward promotion into RAM (at the ``promote_min_hits``-th
read from a lower tier, off the critical path); a save is write-through to every tier; a
tier never evicts the last copy of a chunk whose children live in another tier, and a chunk
that left every tier takes its descendants with it (``TieredStore._cascade``).
Read time per tier touched: ``op_latency_s + chunks * (chunk_latency_s + chunk_bytes / read_bw)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.eviction import EvictionPolicy, PolicyName
from kvtier.sim.profile import TierProfile

TIER_NAMES = ("ram", "ssd", "shared")


@dataclass
class TierModel:
    name: str
    capacity_chunks: int
    speed: TierProfile
    chunk_bytes: int
    chunk_tokens: int
    policy: EvictionPolicy
    evictions: int = 0

    @classmethod
    def open(cls, name: str, speed: TierProfile, chunk_bytes: int, chunk_tokens: int,
             policy: PolicyName) -> "TierModel":
        return cls(name, int(speed.capacity // max(chunk_bytes, 1)), speed, chunk_bytes, chunk_tokens,
                   EvictionPolicy(policy))

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

    @classmethod
    def open(cls, speeds: dict[str, TierProfile], chunk_bytes: int, chunk_tokens: int, policy: PolicyName,
             promote_min_hits: int) -> "StoreModel":
        tiers = [TierModel.open(n, speeds[n], chunk_bytes, chunk_tokens, policy) for n in TIER_NAMES
                 if speeds[n].capacity >= chunk_bytes]
        return cls(tiers, promote_min_hits)

    def present(self, key: int) -> bool:
        return any(key in t for t in self.tiers)

    def lookup(self, keys: list[int]) -> list[int]:
        """Tier index serving each chunk of the longest available prefix."""
        out: list[int] = []
        tiers = self.tiers
        for k in keys:
            for i, t in enumerate(tiers):
                if k in t.policy:
                    out.append(i)
                    break
            else:
                break
        return out

    def read(self, keys: list[int], where: list[int]) -> float:
        """Load ``keys`` from the tiers ``where`` names; returns the synchronous load time."""
        counts = [0] * len(self.tiers)
        ram = self.tiers[0] if self.tiers and self.tiers[0].name == "ram" else None
        for j, (k, i) in enumerate(zip(keys, where)):
            counts[i] += 1
            self.tiers[i].policy.touch(k)
            if ram is not None and i > 0:
                c = self._lower_hits.get(k, 0) + 1
                if c >= self.promote_min_hits:
                    self._lower_hits.pop(k, None)
                    parent = keys[j - 1] if j else None
                    if parent is None or parent in ram.policy:
                        self._put(0, k, parent)
                        self.promotions += 1
                else:
                    self._lower_hits[k] = c
        return sum(t.read_time(n) for t, n in zip(self.tiers, counts))

    def save(self, keys: list[int], start: int) -> None:
        """Write-through of chunks ``keys[start:]`` (``keys`` = the prompt's whole chain)."""
        n_tiers = range(len(self.tiers))
        for j in range(start, len(keys)):
            parent = keys[j - 1] if j else None
            if j == start and parent is not None and not self.present(parent):
                return                         # orphan put: refused, like TieredStore.put
            stored = False
            for i in n_tiers:
                stored = self._put(i, keys[j], parent) or stored
            if not stored:
                return                         # the rest would be orphans

    def _put(self, i: int, key: int, parent: int | None) -> bool:
        tier = self.tiers[i]
        pol = tier.policy
        if key in pol:
            pol.touch(key)
            return True
        cap = tier.capacity_chunks
        if cap <= 0:
            return False
        if len(pol) >= cap:
            others = [t.policy for t in self.tiers if t is not tier]

            def keep(k: int) -> bool:   # never the new chunk's parent, nor the last copy of a chunk
                return k == parent or (  # whose children live in another tier
                    any(o.has_children(k) for o in others) and not any(k in o for o in others))
            while len(pol) >= cap:
                victim = pol.pick(exclude=keep)
                if victim is None:
                    return False
                pol.remove(victim)
                tier.evictions += 1
                if not any(victim in o for o in others):
                    self._cascade(victim)
        pol.add(key, parent, tier.chunk_bytes, tier.chunk_tokens)
        return True

    def _cascade(self, key: int) -> None:
        work = [key]
        while work:
            k = work.pop()
            for t in self.tiers:
                for child in t.policy.descendants(k):
                    t.policy.remove(child)
                    work.append(child)
