"""The scheduler's view of the worker's RAM tier as kvtier's connector of 2026-11-30 had it.

With vLLM's multiprocess executor (the default on CPU) the worker runs in another process
than the scheduler, and the worker's RAM tier is invisible to the scheduler. Since 2026-12-01
the worker reports stored, promoted and evicted keys, so the scheduler's directory follows
the RAM tier (``ram_view: exact``, the default, models that). The connector of 2026-11-30 —
the one the committed companion and SLO demo runs of that day used — knew only the last N
keys the worker reported *stored* (N = RAM capacity in chunks; LRU by report time), and forgot
a key only when a load of it failed (``ram_view: stored_keys``, modelled here):

* lookup (scheduler): a chunk counts as available when it is among those keys, or in a tier
  the scheduler sees itself (SSD, shared); the claim is the leading run of such chunks. The
  RAM tier's prefix-aware LRU keeps a conversation's first chunks (parents) while the key list
  drops them first (reported first): a returning conversation can then be claimed not at all
  although RAM still holds its prefix, and claimed for chunks RAM already evicted;
* load (worker): each claimed chunk from the first tier holding it; the first chunk no tier
  holds fails, and every later one of the claim with it (vLLM recomputes them; the failed key
  is forgotten). Only the chunks that loaded count as hits. The step vLLM loses rescheduling
  the request after a failed load is not modelled;
* save (worker): chunks from the end of the scheduler's claim on (never what it believed
  stored), each put into every tier; a chunk stored anywhere is reported (appended to the keys,
  the oldest dropped past N). Promotions into RAM are not reported (as then).

Not thread-safe; one simulation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.sim.tiers import StoreModel


@dataclass
class StoredKeysStore(StoreModel):
    view_capacity: int = 0
    view: OrderedDict = field(default_factory=OrderedDict)   # key -> None, oldest report first
    failed_loads: int = 0

    @classmethod
    def over(cls, store: StoreModel) -> "StoredKeysStore":
        """The same tiers seen through the stored-keys list (RAM must be the first tier)."""
        if not store.tiers or store.tiers[0].name != "ram":
            raise ValueError("ram_view stored_keys needs a RAM tier")
        return cls(store.tiers, store.promote_min_hits, view_capacity=store.tiers[0].capacity_chunks)

    def lookup(self, keys: list[int]) -> list[int]:
        """Per chunk of the claimable prefix, the tier the scheduler believes holds it (0 = RAM)."""
        has = self._methods()[1][1:]
        view = self.view
        out: list[int] = []
        for k in keys:
            if k in view:
                out.append(0)
                continue
            for i, h in enumerate(has, 1):
                if h(k):
                    out.append(i)
                    break
            else:
                break
        return out

    def load(self, keys: list[int], where: list[int]) -> tuple[float, list[int]]:
        """The worker loads a claim: (time, tier serving each chunk that loaded — a prefix of
        ``keys``). ``where`` (the scheduler's belief) is not used: the worker asks its tiers."""
        has = self._methods()[1]
        served: list[int] = []
        for k in keys:
            for i, h in enumerate(has):
                if h(k):
                    served.append(i)
                    break
            else:
                self.view.pop(k, None)          # reported missing: forgotten
                self.failed_loads += 1
                break
        return self.read(keys[:len(served)], served), served

    def save(self, keys: list[int], start: int) -> None:
        if start >= len(keys):
            return
        parent = keys[start - 1] if start else None
        if parent is not None and not self.present(parent):
            return                              # orphan put: refused
        view, cap = self.view, self.view_capacity
        for j in range(start, len(keys)):
            key = keys[j]
            stored = False
            for i in range(len(self.tiers)):
                if self._put(i, key, parent):
                    stored = True
            if not stored:
                break
            view[key] = None                    # the worker reports it stored
            view.move_to_end(key)
            if len(view) > cap:
                view.popitem(last=False)
            parent = key
