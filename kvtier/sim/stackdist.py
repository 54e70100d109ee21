"""Miss-ratio curves from LRU stack distances, in one pass (exact, or SHARDS-sampled).

The access stream: requests in nominal send order, each reading its prompt's full kvtier
chunks in order. An access's stack distance = distinct chunks touched since that chunk's
last access (Mattson: an LRU cache of C chunks hits iff distance < C); first accesses are
cold (infinite). Prefix rule: a chunk is only usable if every earlier chunk of its prompt
is, so an access's effective distance is the running maximum over its request. Hit rate at
capacity C = tokens of accesses with effective distance < C / all prompt tokens.

Which chunk of a conversation an LRU tier drops first decides what is left of a returning prompt.
``tail_first=False`` is plain LRU over the stream: a request reads its chunks head first, so the
head is the least recent and goes first, and the prefix rule then loses the whole prompt while its
other chunks stay, unusable. kvtier's tiers (``kvtier.eviction``: only leaves, chain tails first)
and vLLM's block pool (a finished request's blocks are freed tail first) drop a chain from its
tail, so a returning prompt keeps the head the capacity still holds. ``tail_first=True`` models
that: every chunk of a request is looked up against the stack as it was when the request came
(its depth = distinct chunks used since its last use), then the request's chunks are used tail
first, so a parent is always more recent than its children; a chunk hits iff its running maximum
depth over the request is below C. LRU stays a stack algorithm in that order, so one pass gives
the curve for every capacity. On the recorded 2-vCPU AVX2 demo run (engine 12 chunks, RAM 22,
prompts in the order they were sent) plain LRU says 58.7% and tail-first 66.1%; the run's RAM-only
hit rate was 65.0% (``tests/unit/test_stackdist_tail_first.py``).

SHARDS (Waldspurger et al., FAST'15): keep only accesses whose key hash falls under
``rate * 2^24`` (a spatially hashed sample: all accesses of a sampled key), compute their
distances, scale by ``1 / rate``. Error vs the exact curve is measured by a test and by
benchmarks/sim/bench_planner.py. Fenwick tree, O(n log n); pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.sim.hashing import mix64
from kvtier.sim.trace import SimTrace

COLD = np.iinfo(np.int64).max


@dataclass(frozen=True)
class AccessStream:
    keys: np.ndarray        # uint64 chunk keys, requests in nominal order, chunks in prompt order
    req: np.ndarray         # int64 request index of each access
    tokens: np.ndarray      # int64 tokens each access can serve
    total_tokens: int       # all prompt tokens (partial chunks included: they always miss)
    chunk_tokens: int


def access_stream(trace: SimTrace, chunk_size: int) -> AccessStream:
    cu = max(1, chunk_size // trace.unit_tokens)
    order = trace.nominal_order()
    keys, reqs, toks = [], [], []
    U = trace.unit_tokens
    for r in order.tolist():
        u = trace.hashes[trace.hoffsets[r]:trace.hoffsets[r + 1]]
        limit = (int(trace.prompt_tokens[r]) - 1) // U        # never the last token (vLLM's rule)
        k = u[cu - 1::cu]
        if len(k) == 0:
            continue
        t = np.full(len(k), cu * U, dtype=np.int64)
        over = (np.arange(1, len(k) + 1) * cu) - limit
        t -= np.clip(over, 0, cu) * U                        # the last chunk may serve in part
        keys.append(k)
        reqs.append(np.full(len(k), r, dtype=np.int64))
        toks.append(t)
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt))
    return AccessStream(cat(keys, np.uint64), cat(reqs, np.int64), cat(toks, np.int64),
                        int(trace.prompt_tokens.sum()), cu * U)


def stack_distances(s: AccessStream, rate: float = 1.0, tail_first: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(effective distances in chunks, token weights) of the (sampled) accesses; weights are
    scaled by ``1 / rate`` so sums estimate the full stream. ``tail_first``: chains are evicted
    from their tail (module docstring)."""
    if not 0 < rate <= 1:
        raise ValueError("sample rate must be in (0, 1]")
    if rate < 1:
        keep = (mix64(s.keys) & np.uint64(0xFFFFFF)) < np.uint64(int(rate * (1 << 24)))
        keys, req, tok = s.keys[keep], s.req[keep], s.tokens[keep]
    else:
        keys, req, tok = s.keys, s.req, s.tokens
    if tail_first:
        out = _tail_first_depths(keys, req)
        if rate < 1:
            warm = out != COLD
            out[warm] = (out[warm] / rate).astype(np.int64)
        return out, tok.astype(np.float64) / rate
    n = len(keys)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    out = np.empty(n, dtype=np.int64)
    klist, rlist = keys.tolist(), req.tolist()
    cur_req, run_max, live = -1, 0, 0
    for i in range(n):
        k = klist[i]
        p = last.get(k)
        if p is None:
            d = COLD
        else:
            # live marks after p: total live - prefix(p)
            j, pre = p + 1, 0
            while j > 0:
                pre += tree[j]
                j -= j & -j
            d = live - pre
            j = p + 1
            while j <= n:
                tree[j] -= 1
                j += j & -j
            live -= 1
        j = i + 1
        while j <= n:
            tree[j] += 1
            j += j & -j
        live += 1
        last[k] = i
        if rlist[i] != cur_req:
            cur_req, run_max = rlist[i], d
        elif d > run_max:
            run_max = d
        out[i] = run_max
    if rate < 1:
        warm = out != COLD
        out[warm] = (out[warm] / rate).astype(np.int64)
    return out, tok.astype(np.float64) / rate


def _tail_first_depths(keys: np.ndarray, req: np.ndarray) -> np.ndarray:
    """Per access, the running maximum (over its request, head first) of its chunk's LRU depth when
    the request came; the request then uses its chunks tail first. Fenwick tree over use times."""
    n = len(keys)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    out = np.empty(n, dtype=np.int64)
    klist, rlist = keys.tolist(), req.tolist()
    live = clock = 0
    i = 0
    while i < n:
        j = i
        while j < n and rlist[j] == rlist[i]:
            j += 1
        run_max = 0
        for a in range(i, j):                       # depths against the stack as the request found it
            p = last.get(klist[a])
            if p is None:
                d = COLD
            else:
                q, pre = p + 1, 0
                while q > 0:
                    pre += tree[q]
                    q -= q & -q
                d = live - pre
            run_max = max(run_max, d)
            out[a] = run_max
        for a in range(j - 1, i - 1, -1):           # then used tail first: the head ends most recent
            k = klist[a]
            p = last.get(k)
            if p is not None:
                q = p + 1
                while q <= n:
                    tree[q] -= 1
                    q += q & -q
                live -= 1
            q = clock + 1
            while q <= n:
                tree[q] += 1
                q += q & -q
            live += 1
            last[k] = clock
            clock += 1
        i = j
    return out


@dataclass(frozen=True)
class MissRatioCurve:
    chunk_bytes: int
    capacities_chunks: np.ndarray     # ascending
    hit_rate: np.ndarray              # token hit rate at each capacity (one LRU tier of that size)
    ideal_hit_rate: float             # infinite cache
    sample_rate: float

    def at(self, capacity_chunks: float) -> float:
        i = np.searchsorted(self.capacities_chunks, capacity_chunks, side="right") - 1
        return float(self.hit_rate[i]) if i >= 0 else 0.0

    def smallest_reaching(self, fraction: float) -> int | None:
        """Smallest capacity (chunks) whose hit rate >= fraction * ideal."""
        want = fraction * self.ideal_hit_rate - 1e-12
        idx = np.flatnonzero(self.hit_rate >= want)
        return int(self.capacities_chunks[idx[0]]) if len(idx) else None


def miss_ratio_curve(s: AccessStream, chunk_bytes: int, rate: float = 1.0, points: int = 200,
                     distances: tuple[np.ndarray, np.ndarray] | None = None,
                     tail_first: bool = False) -> MissRatioCurve:
    """The curve of ``s`` (``distances``: its ``stack_distances(s, rate, tail_first)`` when the caller
    has them)."""
    d, w = stack_distances(s, rate, tail_first) if distances is None else distances
    total = s.total_tokens
    warm = d != COLD
    ideal = float(w[warm].sum() / total) if total else 0.0
    dw = d[warm]
    if len(dw) == 0:
        caps = np.array([1], dtype=np.int64)
        return MissRatioCurve(chunk_bytes, caps, np.zeros(1), ideal, rate)
    order = np.argsort(dw, kind="stable")
    ds, cw = dw[order], np.cumsum(w[warm][order])
    hi = int(ds.max()) + 1
    caps = np.unique(np.concatenate([np.geomspace(1, hi, points).astype(np.int64), ds + 1]))
    idx = np.searchsorted(ds, caps, side="left")           # accesses with d < cap
    hits = np.where(idx > 0, cw[np.maximum(idx - 1, 0)], 0.0)
    return MissRatioCurve(chunk_bytes, caps, hits / total if total else hits * 0, ideal, rate)
