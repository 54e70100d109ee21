"""A request's admission into the simulated engine: prefix-cache and kvtier lookup, KV block
allocation, the synchronous kvtier load, and what happens when its prefill completes
(blocks cached, chunks saved to kvtier). ``Admission`` is mixed into ``EngineSim``
(``kvtier.sim.scheduler``), whose ``trace``, ``profile``, ``cache``, ``store``, ``U`` and
``chunk_units`` it uses.
"""

from __future__ import annotations


from kvtier.sim.prefix_cache import PrefixCacheModel
from kvtier.sim.profile import SimProfile
from kvtier.sim.tiers import StoreModel
from kvtier.sim.trace import SimTrace


class SimRequest:
    """One request's state in the engine (an admission may be repeated after a preemption)."""

    __slots__ = ("r", "send", "prompt", "out", "done", "remaining", "cached", "private", "units", "stored",
                 "done_ctx", "ncommit", "gen", "epoch", "g0", "alloc", "admitted")

    def __init__(self, r: int, send: float, prompt: int, out: int) -> None:
        self.r, self.send, self.prompt, self.out = r, send, prompt, out
        self.done = self.remaining = self.private = 0
        self.cached: list[int] = []
        self.units: list[int] = []
        self.stored = 0          # chunks kvtier held at admission (saving starts after them)
        self.done_ctx = 0
        self.ncommit = 0         # units [0, ncommit) went through the prefix cache (hit or committed)
        self.gen = 0             # tokens generated before a preemption (recomputed with the prompt)
        self.epoch = 0           # +1 per preemption: heap entries of an earlier admission are stale
        self.g0 = 0              # the step that completed this admission's prefill
        self.alloc = 0           # KV blocks held (hit + private)
        self.admitted = False    # the first admission's hits are what the request reports

    @property
    def plen(self) -> int:
        """Tokens to prefill on this admission: the prompt plus what a preemption discarded."""
        return self.prompt + self.gen


class Admission:
    trace: SimTrace
    profile: SimProfile
    cache: PrefixCacheModel
    store: StoreModel | None
    U: int
    chunk_units: int
    _hoff: list[int]          # trace.hoffsets as Python ints (no numpy scalar per admission)
    _preemption: bool
    _partial_loads: bool      # the store may fail a claimed chunk (kvtier.sim.ram_view)
    chunks_read: list[int] | None   # chunks loaded per store tier, when counted (a cluster's replicas)

    def _admit(self, q: SimRequest, tiers: dict[str, list[int]], load_arr: list[float], tier_keys: list[str]) -> float | None:
        """Look the prompt up, allocate KV blocks; the synchronous kvtier load time, or None
        when the KV cache has no room now. The first admission's hits are recorded."""
        U, cu, tr = self.U, self.chunk_units, self.trace
        plen = q.prompt + q.gen
        r = q.r
        ho = self._hoff
        units = tr.hashes[ho[r]:ho[r + 1]].tolist()
        max_hit = min(len(units), (plen - 1) // U)
        cache = self.cache
        gpu_hit, hit_free = cache.match_free(units, max_hit)
        total_units = -(-plen // U) if self._preemption else -(-(q.prompt + q.out) // U)
        if not cache.fits(gpu_hit, hit_free, total_units):
            return None                 # (before the store lookup, which is pure: a blocked head retries)
        gpu_units = units[:gpu_hit]
        ext_units, where, keys = 0, [], units
        store = self.store
        if store is not None:
            if cu != 1:
                keys = units[cu - 1::cu]
            where = store.lookup(keys)
            ext_units = min(len(where) * cu, max_hit)
            q.stored = len(where)
        hit_n = ext_units if ext_units > gpu_hit else gpu_hit
        # units loaded from kvtier are this request's own blocks (cached at commit, like computed ones)
        cache.acquire(gpu_units, total_units)
        q.cached = gpu_units
        q.ncommit = gpu_hit
        q.private = total_units - gpu_hit
        q.alloc = total_units
        q.units = units
        first = not q.admitted
        q.admitted = True
        if first:
            tiers["gpu"][r] = gpu_hit * U
        load_t = 0.0
        if ext_units > gpu_hit:
            first_c, last_c = gpu_hit // cu, -(-ext_units // cu)       # chunks overlapping the claim
            ks, ws = keys[first_c:last_c], where[first_c:last_c]
            if self._partial_loads:
                load_t, ws = store.load(ks, ws)     # kvtier.sim.ram_view: the tiers that served
                if len(ws) < len(ks):               # a claimed chunk no tier holds: the rest is recomputed
                    last_c = first_c + len(ws)
                    ext_units = min(ext_units, last_c * cu)
                    hit_n = ext_units if ext_units > gpu_hit else gpu_hit
            else:
                load_t = store.read(ks, ws)
            reads = self.chunks_read
            if reads is not None:
                for w in ws:
                    reads[w] += 1
            if first:
                if cu == 1:                     # one unit per chunk: every claimed chunk is whole
                    per = [0] * len(tier_keys)
                    for w in ws:
                        per[w] += 1
                else:
                    per = [0] * len(tier_keys)
                    for j, w in zip(range(first_c, last_c), ws):
                        per[w] += min((j + 1) * cu, ext_units) - max(j * cu, gpu_hit)
                for w, n_units in enumerate(per):
                    if n_units:
                        tiers[tier_keys[w]][r] += n_units * U
        if first:
            load_arr[r] = load_t
        q.done = hit_n * U
        q.remaining = plen - q.done
        return load_t

    def _commit(self, q: SimRequest, upto: int) -> None:
        upto = min(upto, len(q.units))
        if upto > q.ncommit:
            newly = self.cache.commit(q.units[q.ncommit:upto])
            q.cached.extend(newly)
            q.private -= len(newly)
            q.ncommit = upto

    def _complete_prefill(self, q: SimRequest) -> None:
        units = q.units
        self._commit(q, len(units))
        if self.store is not None and self.profile.save:
            cu = self.chunk_units
            self.store.save(units if cu == 1 else units[cu - 1::cu], q.stored)   # never re-save what the store held
        q.units = []
