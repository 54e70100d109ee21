"""The event loop: one vLLM engine (continuous batching, chunked prefill) fed by a load.

Each engine step, as vLLM v1 schedules it: every decoding request gets one token; running
(partially prefilled) requests continue their prefill, first come first served, within the
step's token budget (``max_num_batched_tokens``); then waiting requests are admitted while
budget, ``max_num_seqs`` and KV blocks allow. Admission looks the prompt up in vLLM's
prefix cache (``PrefixCacheModel``) and then in kvtier (``StoreModel``: chunks past vLLM's
own hit, loaded synchronously inside that step, so the whole step waits for the load).
A prompt is never fully cached: at least its last token is computed, and hits are cut to
whole blocks below ``prompt - 1`` (vLLM's rule). Full blocks enter the prefix cache at the end of the step that computed them. A request's
first token is produced at
the end of the step that completes its prefill (TTFT), then one token per step (outputs
of exactly ``max_tokens``, like the replay's ``ignore_eos``). KV blocks for prompt and
output are reserved at admission. Between events (arrival, prefill, finish) runs of pure
decode steps are jumped over in closed form, so the cost is per request, not per token.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from kvtier.sim.costs import StepCost
from kvtier.sim.load import LoadSpec, conversation_starts
from kvtier.sim.prefix_cache import PrefixCacheModel
from kvtier.sim.profile import SimProfile
from kvtier.sim.tiers import TIER_NAMES, StoreModel
from kvtier.sim.trace import SimTrace


@dataclass
class SimResult:
    """Per-request arrays (index = request index in the trace); ``sent`` False = never issued."""
    sent: np.ndarray
    ok: np.ndarray
    send_s: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    cached_tokens: np.ndarray
    tier_tokens: dict[str, np.ndarray]     # gpu, ram, ssd, shared
    load_s: np.ndarray
    output_tokens: np.ndarray
    duration_s: float
    steps: int
    counters: dict[str, int]


class _Req:
    __slots__ = ("r", "send", "prompt", "out", "done", "remaining", "cached", "private", "units", "stored",
                 "done_ctx", "ncommit")

    def __init__(self, r: int, send: float, prompt: int, out: int) -> None:
        self.r, self.send, self.prompt, self.out = r, send, prompt, out
        self.done = self.remaining = self.private = 0
        self.cached: list[int] = []
        self.units: list[int] = []
        self.stored = 0          # chunks kvtier held at admission (saving starts after them)
        self.done_ctx = 0
        self.ncommit = 0         # units [0, ncommit) went through the prefix cache (hit or committed)


class EngineSim:
    """One simulated engine + store over a trace. ``run()`` is the whole simulation."""

    def __init__(self, trace: SimTrace, profile: SimProfile, load: LoadSpec) -> None:
        load.validate()
        self.trace, self.profile, self.load = trace, profile, load
        e = profile.engine
        self.U = trace.unit_tokens
        self.cost = StepCost.of(e)
        self.cache = PrefixCacheModel(e.kv_cache_tokens // self.U, e.prefix_caching)
        self.chunk_units = max(1, profile.chunk_size // self.U)
        chunk_tokens = self.chunk_units * self.U
        self.store = (StoreModel.open({"ram": profile.ram, "ssd": profile.ssd, "shared": profile.shared},
                                      chunk_tokens * profile.kv_bytes_per_token, chunk_tokens, profile.eviction,
                                      profile.promote_min_hits)
                      if profile.kvtier_enabled() else None)

    def run(self, progress: Callable[[int], None] | None = None) -> SimResult:
        """The whole simulation."""
        for _ in self.steps(progress):
            pass
        return self.result

    def steps(self, progress: Callable[[int], None] | None = None) -> Iterator[float]:
        """The simulation as a generator: yields the engine's clock before each scheduling
        round (several engines sharing a tier advance in clock order, ``kvtier.sim.cluster``);
        ``self.result`` is set when it is exhausted."""
        tr, ld, e = self.trace, self.load, self.profile.engine
        n = tr.num_requests
        U, cu = self.U, self.chunk_units
        send = np.full(n, np.nan)
        ttft = np.full(n, np.nan)
        e2e = np.full(n, np.nan)
        cached_tok = np.zeros(n, dtype=np.int64)
        tiers = {k: np.zeros(n, dtype=np.int64) for k in ("gpu", *TIER_NAMES)}
        load_arr = np.zeros(n)
        ok = np.zeros(n, dtype=bool)
        sent = np.zeros(n, dtype=bool)
        failed = 0
        out_tokens = tr.max_tokens if ld.max_tokens is None else np.minimum(tr.max_tokens, ld.max_tokens)
        tier_keys = [t.name for t in self.store.tiers] if self.store else []

        arrivals: list[tuple[float, int, int]] = []    # (time, seq, request index)
        seq = 0
        issued = 0
        limit_t = ld.duration_s if ld.duration_s is not None else float("inf")
        limit_n = ld.max_requests if ld.max_requests is not None else n
        conv_of = np.repeat(np.arange(tr.num_conversations), np.diff(tr.conv_offsets))
        next_conv = 0

        def issue(r: int, t: float) -> None:
            nonlocal seq, issued
            if issued >= limit_n or t > limit_t:
                return
            hint = tr.arrival_hint_s[r]
            if ld.mode == "trace" and not np.isnan(hint):
                t = max(t, hint * ld.time_scale)
                if t > limit_t:
                    return
            issued += 1
            seq += 1
            heapq.heappush(arrivals, (t, seq, r))

        def start_next_conversation(t: float) -> None:
            nonlocal next_conv
            while next_conv < tr.num_conversations:
                c = next_conv
                next_conv += 1
                if tr.conv_offsets[c + 1] > tr.conv_offsets[c]:
                    issue(int(tr.conv_offsets[c]), t)
                    return

        if ld.mode == "closed":
            for _ in range(ld.concurrency):
                start_next_conversation(0.0)
        else:
            for t0, c in conversation_starts(ld, tr.conv_arrival_s.tolist()):
                if tr.conv_offsets[c + 1] > tr.conv_offsets[c]:
                    issue(int(tr.conv_offsets[c]), t0)

        def finished(q: _Req, t: float) -> None:
            r = q.r
            e2e[r] = t - q.send + e.request_overhead_s
            ok[r] = True
            self.cache.release(q.cached, q.private)
            after_request(r, t)

        def after_request(r: int, t: float) -> None:
            c = conv_of[r]
            if r + 1 < tr.conv_offsets[c + 1]:
                issue(r + 1, t + tr.think_s[r + 1] * ld.think_time_scale)
            elif ld.mode == "closed":
                start_next_conversation(t)

        now = 0.0
        G = 0                                   # engine steps done
        waiting: deque[_Req] = deque()
        prefilling: list[_Req] = []
        decode_heap: list[tuple[int, int, _Req]] = []   # (finish step, request index, req)
        ctx_base = 0                            # decode context = ctx_base + D * G
        steps = 0
        B, max_seqs = e.max_num_batched_tokens, e.max_num_seqs
        cost, cache, store = self.cost, self.cache, self.store
        done_count = 0
        blocked = False                          # the head of the queue waits for KV space

        while True:
            yield now
            while arrivals and arrivals[0][0] <= now:
                t, _, r = heapq.heappop(arrivals)
                send[r] = t
                sent[r] = True
                waiting.append(_Req(r, t, int(tr.prompt_tokens[r]), int(out_tokens[r])))   # (an arrival
                # frees no KV block: a blocked queue head stays blocked until a request finishes)
            D = len(decode_heap)
            if not prefilling and not D and not waiting:
                if not arrivals:
                    break
                now = arrivals[0][0]
                continue
            if not prefilling and D and (not waiting or blocked or D >= max_seqs):
                # pure decode until the next finish or the next arrival
                k = decode_heap[0][0] - G
                ctx = ctx_base + D * G
                if arrivals:
                    k = min(k, cost.decode_steps_until(arrivals[0][0] - now, D, ctx))
                now += cost.decode_run(k, D, ctx)
                G += k
                steps += k
                while decode_heap and decode_heap[0][0] <= G:
                    _, _, q = heapq.heappop(decode_heap)
                    ctx_base -= q.done_ctx
                    finished(q, now)
                    done_count += 1
                    blocked = False
                if progress is not None:
                    progress(done_count)
                continue
            # one mixed step
            budget = B - D
            P = 0
            pairs = 0.0
            load_t = 0.0
            for q in prefilling:
                if budget <= 0:
                    break
                take = min(q.remaining, budget)
                pairs += cost.pairs(q.done, take)
                q.done += take
                q.remaining -= take
                P += take
                budget -= take
            running = D + len(prefilling)
            while waiting and budget > 0 and running < max_seqs and not blocked:
                q = waiting[0]
                lt = self._admit(q, tiers, load_arr, tier_keys)
                if lt is None:
                    if cache.used_by_nobody():
                        waiting.popleft()       # can never fit: fails like an over-long prompt
                        failed += 1
                        after_request(q.r, now)
                        continue
                    blocked = True
                    break
                waiting.popleft()
                load_t += lt
                prefilling.append(q)
                running += 1
                take = min(q.remaining, budget)
                pairs += cost.pairs(q.done, take)
                q.done += take
                q.remaining -= take
                P += take
                budget -= take
            if P == 0 and D == 0:
                if blocked and not prefilling:
                    blocked = False             # nothing running and still blocked: retry next round
                    if arrivals:
                        now = max(now, arrivals[0][0])
                    continue
            now += cost.step(P, pairs, D, ctx_base + D * G) + load_t
            G += 1
            steps += 1
            still = []
            for q in prefilling:
                if q.remaining > 0:
                    self._commit(q, q.done // self.U)       # vLLM caches full blocks as each step computes them
                    still.append(q)
                    continue
                r = q.r
                ttft[r] = now - q.send + e.request_overhead_s
                self._complete_prefill(q)
                if q.out <= 1:
                    finished(q, now)
                    done_count += 1
                else:
                    q.done_ctx = q.prompt - G
                    ctx_base += q.done_ctx
                    heapq.heappush(decode_heap, (G + q.out - 1, r, q))
            prefilling = still
            while decode_heap and decode_heap[0][0] <= G:
                _, _, q = heapq.heappop(decode_heap)
                ctx_base -= q.done_ctx
                finished(q, now)
                done_count += 1
                blocked = False
            if progress is not None and steps % 256 == 0:
                progress(done_count)
        if progress is not None:
            progress(done_count)
        counters = {"steps": steps, "gpu_evictions": cache.evictions, "failed_admission": failed}
        if store is not None:
            counters["promotions"] = store.promotions
            for t in store.tiers:
                counters[f"{t.name}_evictions"] = t.evictions
                counters[f"{t.name}_capacity_chunks"] = t.capacity_chunks
        cached_tok[:] = sum(tiers.values())
        self.result = SimResult(sent=sent, ok=ok, send_s=send, ttft_s=ttft, e2e_s=e2e, cached_tokens=cached_tok,
                                tier_tokens=tiers, load_s=load_arr,
                                output_tokens=np.asarray(out_tokens, dtype=np.int64), duration_s=float(now),
                                steps=steps, counters=counters)

    def _admit(self, q: _Req, tiers: dict[str, np.ndarray], load_arr: np.ndarray, tier_keys: list[str]) -> float | None:
        """Look the prompt up, reserve KV blocks; the synchronous kvtier load time, or None
        when the KV cache has no room now."""
        U, cu, tr = self.U, self.chunk_units, self.trace
        units = tr.hashes[tr.hoffsets[q.r]:tr.hoffsets[q.r + 1]].tolist()
        max_hit = min(len(units), (q.prompt - 1) // U)
        gpu_hit = self.cache.match(units[:max_hit])
        total_units = -(-(q.prompt + q.out) // U)
        hit = units[:gpu_hit]
        ext_units, where, keys = 0, [], []
        if self.store is not None:
            keys = units[cu - 1::cu]
            where = self.store.lookup(keys)
            ext_units = len(where) * cu
            ext_units = min(ext_units, max_hit)
            q.stored = len(where)
        if ext_units > gpu_hit:
            hit = units[:ext_units]
        if not self.cache.can_allocate(hit[:gpu_hit], total_units):
            return None
        # units loaded from kvtier are this request's own blocks (cached at commit, like computed ones)
        self.cache.acquire(hit[:gpu_hit], total_units)
        q.cached = list(hit[:gpu_hit])
        q.ncommit = gpu_hit
        q.private = total_units - gpu_hit
        q.units = units
        r = q.r
        tiers["gpu"][r] = gpu_hit * U
        load_t = 0.0
        if ext_units > gpu_hit:
            first, last = gpu_hit // cu, -(-ext_units // cu)       # chunks overlapping the claim
            ks, ws = keys[first:last], where[first:last]
            load_t = self.store.read(ks, ws)
            for j, w in zip(range(first, last), ws):
                n_units = min((j + 1) * cu, ext_units) - max(j * cu, gpu_hit)
                tiers[tier_keys[w]][r] += n_units * U
        load_arr[r] = load_t
        q.done = len(hit) * U
        q.remaining = q.prompt - q.done
        return load_t

    def _commit(self, q: _Req, upto: int) -> None:
        if upto > q.ncommit:
            newly = self.cache.commit(q.units[q.ncommit:upto])
            q.cached.extend(newly)
            q.private -= len(newly)
            q.ncommit = upto

    def _complete_prefill(self, q: _Req) -> None:
        units = q.units
        self._commit(q, len(units))
        if self.store is not None and self.profile.save:
            cu = self.chunk_units
            self.store.save(units[cu - 1::cu], q.stored)     # never re-save what the store held
        q.units = []
