"""The event loop: one vLLM engine (continuous batching, chunked prefill) fed by a load.

Each engine step, as vLLM v1 schedules it: every decoding request gets one token; running
(partially prefilled) requests continue their prefill, first come first served, within the
step's token budget (``max_num_batched_tokens``); then waiting requests are admitted while
budget, ``max_num_seqs`` and KV blocks allow. Admission looks the prompt up in vLLM's
prefix cache (``PrefixCacheModel``) and then in kvtier (``StoreModel``: chunks past vLLM's
own hit, loaded synchronously inside that step, so the whole step waits for the load).
A prompt is never fully cached: at least its last token is computed, and hits are cut to
whole blocks below ``prompt - 1`` (vLLM's rule). Full blocks enter the prefix cache at the
end of the step that computed them. A request's first token is produced at the end of the
step that completes its prefill (TTFT), then one token per step (outputs of exactly
``max_tokens``, like the replay's ``ignore_eos``).

KV blocks (``engine.preemption``, vLLM v1's recompute preemption): admission allocates the
prompt's blocks; a decoding request takes one more block the step its context crosses a block
boundary. When the pool (empty + evictable cached blocks) has none, the most recently
admitted running request is preempted — its blocks freed (cached ones stay cached until
evicted), put back at the head of the queue, later re-admitted to recompute its prompt plus
the tokens it had generated (vLLM caches full output blocks too; the model does not, so a
recompute re-hits the prompt only) — and no new request is admitted in that step. A request
that alone cannot fit fails (``kv_cache_too_small``). With ``preemption: false`` the blocks
for prompt and output are reserved at admission instead (no preemption).

Between events (arrival, prefill, finish, a block allocation that fails) runs of pure decode
steps are jumped over in closed form, so the cost is per request and per KV block, never per
token.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterator

import numpy as np

from kvtier.sim.admission import Admission, SimRequest as _Req
from kvtier.sim.costs import StepCost
from kvtier.sim.issue import INF, Feed, LoadIssuer
from kvtier.sim.load import LoadSpec
from kvtier.sim.nogc import gc_paused
from kvtier.sim.prefix_cache import PrefixCacheModel
from kvtier.sim.profile import SimProfile
from kvtier.sim.ram_view import StoredKeysStore
from kvtier.sim.result import SimResult
from kvtier.sim.tiers import TIER_NAMES, StoreModel
from kvtier.sim.trace import SimTrace


class EngineSim(Admission):
    """One simulated engine + store over a trace. ``run()`` is the whole simulation.

    With a ``feed`` the engine's own load is off (``load`` gives only ``max_tokens``): requests
    arrive by ``admit``, each finish or failure is reported to ``feed.done``, and ``steps()``
    also yields at the end of every mixed step (its effects: cached blocks, saves, TTFTs, happen
    then), before every pure-decode run (the run's end: an ``admit`` earlier than that, while
    ``truncatable``, cuts the run at the first step boundary after the arrival) and, idle, inf
    (until an ``admit``; resumed without one, the generator ends). Without a feed the yields
    and results are those of the engine alone."""

    def __init__(self, trace: SimTrace, profile: SimProfile, load: LoadSpec, feed: Feed | None = None) -> None:
        load.validate()
        self.trace, self.profile, self.load, self.feed = trace, profile, load, feed
        self.truncatable = False
        self.chunks_read: list[int] | None = None     # with a feed: chunks loaded per store tier
        self._arrivals: list[tuple[float, int, int]] = []
        e = profile.engine
        self.U = trace.unit_tokens
        self.cost = StepCost.of(e)
        self.cache = PrefixCacheModel(e.kv_cache_tokens // self.U, e.prefix_caching)
        self.chunk_units = max(1, profile.chunk_size // self.U)
        self._hoff = trace.hoffsets.tolist()
        self._preemption = e.preemption
        chunk_tokens = self.chunk_units * self.U
        self.store = (StoreModel.open({"ram": profile.ram, "ssd": profile.ssd, "shared": profile.shared},
                                      chunk_tokens * profile.kv_bytes_per_token, chunk_tokens, profile.eviction,
                                      profile.promote_min_hits)
                      if profile.kvtier_enabled() else None)
        if (self.store is not None and profile.ram_view == "stored_keys" and self.store.tiers
                and self.store.tiers[0].name == "ram"):
            self.store = StoredKeysStore.over(self.store)
        self._partial_loads = isinstance(self.store, StoredKeysStore)   # a claimed chunk may fail to load

    def admit(self, r: int, t: float, seq: int) -> None:
        """Request ``r`` arrives at ``t`` (``seq``: the sender's unique issue order); with a feed,
        while ``steps()`` runs."""
        heapq.heappush(self._arrivals, (t, seq, r))

    def run(self, progress: Callable[[int], None] | None = None) -> SimResult:
        """The whole simulation (the cyclic GC paused meanwhile: ``kvtier.sim.nogc``)."""
        with gc_paused():
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
        # per-request state and results in Python lists (a numpy scalar per access costs ~5x a
        # list item), turned into the result's arrays at the end
        nan = float("nan")
        send = [nan] * n
        ttft = [nan] * n
        e2e = [nan] * n
        tiers = {k: [0] * n for k in ("gpu", *TIER_NAMES)}
        load_arr = [0.0] * n
        ok = [False] * n
        sent = [False] * n
        failed = 0
        out_tokens = tr.max_tokens if ld.max_tokens is None else np.minimum(tr.max_tokens, ld.max_tokens)
        out_l, prompt_l = out_tokens.tolist(), tr.prompt_tokens.tolist()
        tier_keys = [t.name for t in self.store.tiers] if self.store else []

        arrivals: list[tuple[float, int, int]] = []    # (time, seq, request index)
        feed = self.feed
        self._arrivals = arrivals                          # admit() pushes here (fed by a cluster)
        if feed is None:
            issuer = LoadIssuer(tr, ld, arrivals)
            issuer.start()
            after_request = issuer.after_request
        else:
            after_request = feed.done
        self.chunks_read = [0] * len(tier_keys) if feed is not None else None   # per tier (admission)
        # The initial arrivals are usually already in (time, seq) order (a trace's starts): they
        # wait in a deque, later ones in the heap, and the next arrival is the smaller head of
        # the two (the same order as one heap: (time, seq) is unique).
        pre: deque[tuple[float, int, int]] = deque()
        if all(arrivals[i] < arrivals[i + 1] for i in range(len(arrivals) - 1)):
            pre.extend(arrivals)
            arrivals.clear()

        def next_arrival_s() -> float:
            """Time of the next arrival (call only when one is queued)."""
            if pre and (not arrivals or pre[0] < arrivals[0]):
                return pre[0][0]
            return arrivals[0][0]

        running: dict[int, _Req] = {}      # admission order (vLLM's running list): the last is preempted first
        waiting: deque[_Req] = deque()
        prefilling: list[_Req] = []
        decode_heap: list[tuple[int, int, int, _Req]] = []   # (finish step, request index, epoch, req)
        grow_heap: list[tuple[int, int, int, _Req]] = []     # (step needing one more block, r, epoch, req)
        preempt_on = e.preemption
        now = 0.0
        G = 0                                   # engine steps done
        n_dec = 0                               # decoding requests
        ctx_base = 0                            # decode context = ctx_base + n_dec * G
        steps = 0
        preemptions = 0
        B, max_seqs = e.max_num_batched_tokens, e.max_num_seqs
        cost, cache, store = self.cost, self.cache, self.store
        done_count = 0
        blocked = False                          # the head of the queue waits for KV space
        no_admit_step = -1                       # a preemption happened scheduling this step

        def finished(q: _Req, t: float) -> None:
            r = q.r
            e2e[r] = t - q.send + e.request_overhead_s
            ok[r] = True
            self.cache.release(q.cached, q.private)
            running.pop(r, None)
            after_request(r, t)

        def pop_finished() -> None:
            nonlocal ctx_base, n_dec, done_count, blocked
            while decode_heap and decode_heap[0][0] <= G:
                _, _, ep, q = heapq.heappop(decode_heap)
                if ep != q.epoch:
                    continue                                   # preempted since
                ctx_base -= q.done_ctx
                n_dec -= 1
                finished(q, now)
                done_count += 1
                blocked = False

        def next_finish() -> int:
            while decode_heap[0][2] != decode_heap[0][3].epoch:
                heapq.heappop(decode_heap)
            return decode_heap[0][0]

        def grow_until(s: int) -> _Req | None:
            """Allocate the blocks decoding requests need up to step ``s``; the request whose
            block the pool cannot give (its event stays queued), or None."""
            while grow_heap and grow_heap[0][0] <= s:
                gs, r, ep, q = grow_heap[0]
                if ep != q.epoch:
                    heapq.heappop(grow_heap)
                    continue
                if not cache.grow(1):
                    return q
                heapq.heappop(grow_heap)
                q.alloc += 1
                q.private += 1
                if gs + U <= q.g0 + q.out - q.gen - 1:
                    heapq.heappush(grow_heap, (gs + U, r, ep, q))
            return None

        def preempt(v: _Req, s: int, needy: _Req) -> None:
            """vLLM's recompute preemption of ``v`` while scheduling step ``s``."""
            nonlocal ctx_base, n_dec, preemptions, failed, blocked
            del running[v.r]
            v.epoch += 1
            if v in prefilling:
                prefilling.remove(v)
            else:
                n_dec -= 1
                ctx_base -= v.done_ctx
                v.gen += s - v.g0                             # tokens produced in steps g0 .. s-1
            cache.release(v.cached, v.private)
            v.cached, v.units, v.private, v.alloc, v.ncommit = [], [], 0, 0, 0
            preemptions += 1
            blocked = False
            if v is needy and not running:                     # it alone overflows the pool: never fits
                failed += 1
                after_request(v.r, now)
                return
            waiting.appendleft(v)

        def schedule_growth(s: int) -> bool:
            """Blocks for step ``s``; preempts the newest running requests until they fit."""
            any_pre = False
            while (q := grow_until(s)) is not None:
                any_pre = True
                preempt(running[next(reversed(running))], s, q)
            return any_pre

        def start_decode(q: _Req) -> None:
            """``q``'s prefill completed in step G (one token produced)."""
            nonlocal ctx_base, n_dec, done_count
            left = q.out - q.gen                               # tokens of this admission, incl. that one
            if left <= 1:
                finished(q, now)
                done_count += 1
                return
            q.g0 = G
            q.done_ctx = q.plen - G
            ctx_base += q.done_ctx
            n_dec += 1
            heapq.heappush(decode_heap, (G + left - 1, q.r, q.epoch, q))
            if preempt_on:
                gs = G + q.alloc * U - q.plen + 1                # first step whose KV overflows its blocks
                if gs <= G + left - 1:
                    heapq.heappush(grow_heap, (gs, q.r, q.epoch, q))

        while True:
            self.truncatable = False
            yield now
            while True:
                if pre and (not arrivals or pre[0] < arrivals[0]):
                    if pre[0][0] > now:
                        break
                    t, _, r = pre.popleft()
                elif arrivals and arrivals[0][0] <= now:
                    t, _, r = heapq.heappop(arrivals)
                else:
                    break
                send[r] = t
                sent[r] = True
                waiting.append(_Req(r, t, prompt_l[r], out_l[r]))   # (an arrival
                # frees no KV block: a blocked queue head stays blocked until a request finishes)
            D = n_dec
            if not prefilling and not D and not waiting:
                if not arrivals and not pre:
                    if feed is None:
                        break
                    self.truncatable = True
                    yield INF                            # idle: until admit(), or the end
                    if not arrivals:
                        break
                now = next_arrival_s()
                continue
            if not prefilling and D and (not waiting or blocked or D >= max_seqs):
                # pure decode until the next finish, arrival or failing block allocation
                k = next_finish() - G
                ctx = ctx_base + D * G
                if arrivals or pre:
                    k = min(k, cost.decode_steps_until(next_arrival_s() - now, D, ctx))
                if feed is not None:                     # until then, an admit() cuts the run short
                    end = now + cost.decode_run(k, D, ctx)
                    self.truncatable = True
                    yield end
                    self.truncatable = False
                    if arrivals and arrivals[0][0] < end:
                        k = min(k, cost.decode_steps_until(arrivals[0][0] - now, D, ctx))
                if grow_heap and grow_heap[0][0] <= G + k and grow_until(G + k) is not None:
                    k = grow_heap[0][0] - 1 - G                 # run up to the step that cannot get its block
                    if k < 1:
                        schedule_growth(G + 1)
                        no_admit_step = G + 1
                        continue
                now += cost.decode_run(k, D, ctx)
                G += k
                steps += k
                pop_finished()
                if progress is not None:
                    progress(done_count)
                continue
            # one mixed step (step G + 1)
            if grow_heap and grow_heap[0][0] <= G + 1 and schedule_growth(G + 1):
                no_admit_step = G + 1
            D = n_dec
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
            n_running = D + len(prefilling)
            admit = no_admit_step != G + 1
            while admit and waiting and budget > 0 and n_running < max_seqs and not blocked:
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
                running[q.r] = q
                load_t += lt
                prefilling.append(q)
                n_running += 1
                take = min(q.remaining, budget)
                pairs += cost.pairs(q.done, take)
                q.done += take
                q.remaining -= take
                P += take
                budget -= take
            if P == 0 and D == 0 and not prefilling:
                if blocked:
                    blocked = False             # nothing running and still blocked: retry next round
                    if feed is not None:
                        nxt = min(arrivals[0][0] if arrivals else INF, feed.next_send_s())
                        now = max(now, nxt) if nxt < INF else now
                    elif arrivals or pre:
                        now = max(now, next_arrival_s())
                    continue
                if not admit:                   # everything was preempted: admit next round
                    no_admit_step = -1
                    continue
            now += cost.step(P, pairs, D, ctx_base + D * G) + load_t
            G += 1
            steps += 1
            if feed is not None:
                yield now                                # the step's effects at its end
            still = []
            for q in prefilling:
                if q.remaining > 0:
                    self._commit(q, q.done // self.U)       # vLLM caches full blocks as each step computes them
                    still.append(q)
                    continue
                if q.gen == 0:
                    ttft[q.r] = now - q.send + e.request_overhead_s
                self._complete_prefill(q)
                start_decode(q)
            prefilling = still
            pop_finished()
            if progress is not None and steps % 256 == 0:
                progress(done_count)
        if progress is not None:
            progress(done_count)
        counters = {"steps": steps, "gpu_evictions": cache.evictions, "failed_admission": failed,
                    "preemptions": preemptions}
        if store is not None:
            counters["promotions"] = store.promotions
            for t in store.tiers:
                counters[f"{t.name}_evictions"] = t.evictions
                counters[f"{t.name}_capacity_chunks"] = t.capacity_chunks
        tiers_a = {k: np.array(v, dtype=np.int64) for k, v in tiers.items()}
        cached_tok = np.zeros(n, dtype=np.int64)
        cached_tok[:] = sum(tiers_a.values())
        self.result = SimResult(sent=np.array(sent, dtype=bool), ok=np.array(ok, dtype=bool),
                                send_s=np.array(send, dtype=np.float64), ttft_s=np.array(ttft, dtype=np.float64),
                                e2e_s=np.array(e2e, dtype=np.float64), cached_tokens=cached_tok,
                                tier_tokens=tiers_a, load_s=np.array(load_arr, dtype=np.float64),
                                output_tokens=np.asarray(out_tokens, dtype=np.int64), duration_s=float(now),
                                steps=steps, counters=counters)
