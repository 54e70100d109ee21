"""The simulator's StoreModel (bound-method caches, specialised guards, per-request accounting)
behaves exactly like the plain model it replaced: the reference below is the original StoreModel,
loops over tiers and the general guard, on the store's own eviction code (kvtier.eviction), while
the model under test uses what it uses in a simulation (kvtier.sim.lru.LeanLRU for LRU tiers).

Hypothesis drives both through random requests over a small prefix tree — lookup, read of the
hit, and a save that may come several requests later (its parent possibly evicted meanwhile:
an orphan put is refused) — on tiny RAM / SSD / shared tiers of any relative size, LRU and
cost, and asserts equal lookups, read times, tier contents, eviction and promotion counts
after every operation. The cross-tier guard (never the last copy of a chunk whose children
live in another tier) matters here: tiers of different sizes evict a chain's copies apart.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.eviction import EvictionPolicy
from kvtier.sim.lru import LeanLRU
from kvtier.sim.profile import TierProfile
from kvtier.sim.tiers import TIER_NAMES, StoreModel, TierModel

CHUNK = 1000


class _RefStore:
    """The original StoreModel, verbatim in behaviour."""

    def __init__(self, tiers: list[TierModel], promote_min_hits: int) -> None:
        self.tiers, self.promote_min_hits = tiers, promote_min_hits
        self.lower: dict[int, int] = {}
        self.promotions = 0
        self.parent: list = [None]

    def present(self, key: int) -> bool:
        return any(t.policy.contains(key) for t in self.tiers)

    def lookup(self, keys: list[int]) -> list[int]:
        out: list[int] = []
        for k in keys:
            for i, t in enumerate(self.tiers):
                if t.policy.contains(k):
                    out.append(i)
                    break
            else:
                break
        return out

    def read(self, keys: list[int], where: list[int]) -> float:
        counts = [0] * len(self.tiers)
        ram = self.tiers[0] if self.tiers and self.tiers[0].name == "ram" else None
        for j, (k, i) in enumerate(zip(keys, where)):
            counts[i] += 1
            self.tiers[i].policy.touch(k)
            if ram is not None and i > 0:
                c = self.lower.get(k, 0) + 1
                if c >= self.promote_min_hits:
                    self.lower.pop(k, None)
                    parent = keys[j - 1] if j else None
                    if parent is None or ram.policy.contains(parent):
                        self._put(0, k, parent)
                        self.promotions += 1
                else:
                    self.lower[k] = c
        return sum(t.read_time(n) for t, n in zip(self.tiers, counts) if n)

    def save(self, keys: list[int], start: int) -> None:
        if start >= len(keys):
            return
        parent = keys[start - 1] if start else None
        if parent is not None and not self.present(parent):
            return
        for j in range(start, len(keys)):
            stored = False
            for i in range(len(self.tiers)):
                if self._put(i, keys[j], parent):
                    stored = True
            if not stored:
                return
            parent = keys[j]

    def _guard(self, i: int):
        others = [o.policy for o in self.tiers if o is not self.tiers[i]]

        def keep(k: int) -> bool:
            if k == self.parent[0]:
                return True
            if any(p.has_children(k) for p in others):
                return not any(p.contains(k) for p in others)
            return False
        return keep

    def _put(self, i: int, key: int, parent: int | None) -> bool:
        t = self.tiers[i]
        if t.capacity_chunks <= 0:
            return False
        self.parent[0] = parent
        ok, n = t.policy.put_evicting(key, parent, t.chunk_bytes, t.chunk_tokens, t.capacity_chunks, self._guard(i))
        t.evictions += n
        return ok


def _tiers(caps: dict[str, int], policy: str, lean: bool) -> list[TierModel]:
    """Tiers with the store's EvictionPolicy, or (``lean``) what TierModel.open picks (LeanLRU for lru)."""
    speeds = {"ram": TierProfile(capacity=caps["ram"] * CHUNK, read_bw=1e9, op_latency_s=1e-5, chunk_latency_s=1e-6),
              "ssd": TierProfile(capacity=caps["ssd"] * CHUNK, read_bw=2e8, op_latency_s=1e-4, chunk_latency_s=2e-6),
              "shared": TierProfile(capacity=caps["shared"] * CHUNK, read_bw=1e8, op_latency_s=1e-3,
                                    chunk_latency_s=3e-6)}
    return [TierModel(n, caps[n], speeds[n], CHUNK, 16, LeanLRU() if lean and policy == "lru" else EvictionPolicy(policy))
            for n in TIER_NAMES if caps[n] > 0]


def _state(tiers: list[TierModel]) -> list:
    return [(t.name, sorted(t.policy.keys()), t.evictions) for t in tiers]


paths = st.lists(st.integers(0, 2), min_size=1, max_size=6)           # a request = a path in a 3-ary trie
requests = st.lists(st.tuples(paths, st.integers(0, 3)), min_size=1, max_size=60)   # (path, save delay)


@settings(max_examples=250, deadline=None)
@given(reqs=requests, ram=st.integers(0, 6), ssd=st.integers(0, 9), shared=st.integers(0, 7),
       policy=st.sampled_from(["lru", "cost"]), promote=st.integers(1, 3))
def test_store_model_equals_the_plain_reference(reqs, ram, ssd, shared, policy, promote) -> None:
    caps = {"ram": ram, "ssd": ssd, "shared": shared}
    fast = StoreModel(_tiers(caps, policy, lean=True), promote)
    ref = _RefStore(_tiers(caps, policy, lean=False), promote)
    ids: dict[tuple, int] = {}
    pending: list[tuple[int, list[int], int]] = []             # (due step, keys, stored)
    for step, (path, delay) in enumerate(reqs):
        keys = [ids.setdefault(tuple(path[:d + 1]), len(ids) + 1) for d in range(len(path))]
        w1, w2 = fast.lookup(keys), ref.lookup(keys)
        assert w1 == w2
        if w1:
            assert fast.read(keys[:len(w1)], w1) == ref.read(keys[:len(w2)], w2)
        pending.append((step + delay, keys, len(w1)))
        for due, ks, stored in [p for p in pending if p[0] <= step]:
            fast.save(ks, stored)
            ref.save(ks, stored)
        pending = [p for p in pending if p[0] > step]
        assert _state(fast.tiers) == _state(ref.tiers)
        assert fast.promotions == ref.promotions

