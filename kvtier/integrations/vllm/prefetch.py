"""Queue-time prefetch (scheduler half): while a request waits in vLLM's queue, the worker copies its
chunks from the SSD or the shared tier into its RAM tier, so that once scheduled it loads from RAM.

What vLLM 0.32 lets a connector see of its waiting queue (``vllm/v1/core/sched/scheduler.py``):

- ``on_new_request(request)`` for every request as it enters the waiting queue (``add_request``);
- ``get_num_new_matched_tokens`` only for the request at the head of the queue, and only in a step
  that has token budget and a free running slot left: the waiting loop stops at ``max_num_seqs`` or
  an empty budget before looking at any waiting request, and at the first request whose blocks do
  not fit (``allocate_slots`` returns None: ``break``), so the requests behind it are not looked at;
- ``request_finished`` for a request finished or aborted while it waits (``finish_requests`` ->
  ``_free_request``);
- ``build_connector_meta`` once per step, after that step's admissions (``update_state_after_alloc``).

So a request seen in ``on_new_request`` and not admitted by the end of a step's scheduling is waiting;
``QueuePrefetch`` tracks those (arrival order, vLLM's FCFS queue order), and in ``build_meta``:

- asks where their chunks are: the store's index and the worker's directory (no I/O), and the shared
  tier once per request (``RemoteLookups``, off the loop; started on arrival; while pending the
  request is passed over, never waited for);
- plans a ``PrefetchPlan`` of the held chunks not in the worker's RAM tier, leading chunks first,
  within ``budget`` bytes reserved for chunks prefetched for requests still waiting (released when
  the request is admitted, finishes or is aborted); a request whose first chunk does not fit waits
  for room (no overtaking: the queue head is served first);
- cancels the rest of a request's prefetch when it finishes or is aborted (``prefetch_cancels``),
  or when it is admitted before its prefetch is done (its load reads what is where; counted ``late``).

Best effort: a failed or slow prefetch is only a miss later (each chunk counted in
``kvtier_connector_prefetch_chunks_total{outcome}``, logged at DEBUG); it never blocks a step and never
changes what is loaded: a claim is still made from the store's index and the directory at admission.
The shared tier's answer given for the prefetch is reused by the admission's lookup (``known_shared``)
instead of asking the shared tier again. Preempted requests (back in the queue without
``on_new_request``) are not prefetched.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from prometheus_client import Counter

from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, PrefetchOutcome, PrefetchPlan
from kvtier.integrations.vllm.request_log import RequestLog
from kvtier.keys import ChunkKey

if TYPE_CHECKING:
    from kvtier.integrations.vllm.directory import RemoteLookups
    from kvtier.integrations.vllm.step_plans import RequestState

log = logging.getLogger("kvtier.connector")

PREFETCH_CHUNKS = Counter("kvtier_connector_prefetch_chunks_total", "Chunks of waiting requests prefetched into "
                          "the worker's RAM tier, by outcome (planned, fetched, resident, failed, cancelled, late)",
                          ["outcome"])
#: tier names that mean "in the worker's RAM" (the store's RAM tier; a directory entry of unknown tier)
RAM_TIERS = frozenset({"memory"})


class SchedulerView(Protocol):
    """What the prefetch needs of the scheduler half (``SchedulerSide``): the request's state (its
    chunk keys), the local chunks it holds (index and directory), the shared tier's lookups."""

    _remote: "RemoteLookups | None"

    def _state(self, request: Any) -> "RequestState | None": ...
    def _available_chunks(self, keys: Sequence[ChunkKey]) -> tuple[int, tuple[str, ...]]: ...


@dataclass
class _Waiting:
    request: Any
    reserved: int = 0                        # bytes of the budget this request's plan holds
    planned: bool = False                    # its plan was sent (or it needs none)
    done: bool = False                       # the worker reported its plan finished
    shared: tuple[int, int] | None = None    # the shared tier holds chunks [start, end) (its answer)


class QueuePrefetch:
    def __init__(self, budget: int, chunk_nbytes: int, *, block_size: int, chunk_size: int,
                 request_log: RequestLog | None = None) -> None:
        if budget < 0 or chunk_nbytes <= 0:
            raise ValueError("prefetch budget must be >= 0 and chunk bytes > 0")
        self.budget = budget
        self.chunk_nbytes = chunk_nbytes
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.log = request_log or RequestLog(None)
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self._cancels: list[str] = []
        self._inflight: set[str] = set()     # plans sent and not reported done (cancel on exit)
        self.used = 0                        # bytes reserved now

    # -- vLLM's events ---------------------------------------------------------------------------
    def arrived(self, request: Any, view: SchedulerView) -> None:
        """(``on_new_request``) Track ``request`` and start its shared-tier existence check now."""
        self._waiting[request.request_id] = _Waiting(request)
        self._held(self._waiting[request.request_id], view)   # starts the query; the answer comes later

    def admitted(self, req_id: str, claimed_tiers: Sequence[str] = ()) -> None:
        """(``update_state_after_alloc``) The request left the queue: release its budget; a prefetch
        still running is cancelled (the load reads each chunk where it is now). ``claimed_tiers``: where
        the claimed chunks are (logged for a prefetched request)."""
        w = self._waiting.pop(req_id, None)
        if w is None:
            return
        self.used -= w.reserved
        if w.reserved:
            self.log.write("prefetch_admitted", req=req_id, prefetch_done=w.done,
                           claimed_tiers={t: list(claimed_tiers).count(t) for t in set(claimed_tiers)})
        if req_id in self._inflight:
            self._cancels.append(req_id)
            PREFETCH_CHUNKS.labels("late").inc()
            self.log.write("prefetch_late", req=req_id)

    def finished(self, req_id: str) -> None:
        """(``request_finished``, also abort) Forget the request; cancel its prefetch if it runs."""
        w = self._waiting.pop(req_id, None)
        if w is not None:
            self.used -= w.reserved
        if req_id in self._inflight:
            self._cancels.append(req_id)

    def known_shared(self, req_id: str, start: int) -> int | None:
        """Chunks from ``start`` on the shared tier holds by the answer given for this waiting request's
        prefetch (None: no answer covers ``start``; ask the shared tier)."""
        w = self._waiting.get(req_id)
        if w is None or w.shared is None:
            return None
        s, e = w.shared
        return e - start if s <= start <= e else None

    def on_done(self, outcomes: dict[str, PrefetchOutcome], states: "dict[str, RequestState] | None" = None) -> None:
        """The worker's reports: count each plan's chunks by outcome, log them. The local part a
        request's earlier lookup found (``local_pending`` in ``states``) is stale now: dropped."""
        for req_id, o in outcomes.items():
            self._inflight.discard(req_id)
            st = states.get(req_id) if states is not None else None
            if st is not None:
                st.local_pending = None
            w = self._waiting.get(req_id)
            if w is not None:
                w.done = True
            for outcome, n in (("fetched", o.fetched), ("resident", o.resident), ("failed", o.failed),
                               ("cancelled", o.cancelled)):
                if n:
                    PREFETCH_CHUNKS.labels(outcome).inc(n)
            if o.failed:
                log.debug("kvtier: prefetch of %s: %d chunk(s) failed (%s): a miss later", req_id, o.failed, o.error)
            self.log.write("prefetched", req=req_id, fetched=o.fetched, resident=o.resident, failed=o.failed,
                           cancelled=o.cancelled, seconds=round(o.seconds, 6), error=o.error,
                           waiting=w is not None)

    # -- the step --------------------------------------------------------------------------------
    def step(self, meta: KvtierConnectorMetadata, view: SchedulerView) -> None:
        """(``build_meta``, after this step's admissions) Cancels, then plans for the requests still
        waiting, in queue order, within the budget."""
        meta.prefetch_cancels.extend(self._cancels)
        self._cancels.clear()
        for req_id, w in self._waiting.items():
            if w.planned:
                continue
            held = self._held(w, view)
            if held is None:
                continue                     # the shared tier's answer is pending: not waited for
            keys, tiers = held
            want = [i for i, t in enumerate(tiers) if t not in RAM_TIERS]
            if not want:
                w.planned = True             # nothing below RAM: nothing to do
                continue
            room = (self.budget - self.used) // self.chunk_nbytes
            take = want[:max(0, room)]
            if not take:
                break                        # no room: the head waits for it, nobody overtakes
            w.planned = True
            w.reserved = len(take) * self.chunk_nbytes
            self.used += w.reserved
            self._inflight.add(req_id)
            meta.prefetches.append(PrefetchPlan(req_id, tuple(bytes(keys[i]) for i in take),
                                                tuple(tiers[i] for i in take)))
            PREFETCH_CHUNKS.labels("planned").inc(len(take))
            self.log.write("prefetch", req=req_id, chunks=len(take), held_chunks=len(tiers),
                           tiers={t: sum(1 for i in take if tiers[i] == t) for t in {tiers[i] for i in take}},
                           skipped_for_budget=len(want) - len(take))

    def _held(self, w: _Waiting, view: SchedulerView) -> tuple[list[ChunkKey], tuple[str, ...]] | None:
        """Keys and tiers of the leading chunks of ``w``'s prompt any tier holds (as far as they can add
        tokens: never the prompt's last token); None while the shared tier's answer is pending."""
        st = view._state(w.request)
        if st is None or not st.keys:
            return [], ()
        limit = (w.request.num_prompt_tokens - 1) // self.block_size * self.block_size
        useful = min(len(st.keys), -(-limit // self.chunk_size))
        n, tiers = view._available_chunks(st.keys[:useful])
        remote = view._remote
        if remote is not None and n < useful and not st.remote_failed:
            if w.shared is not None and w.shared[0] == n:
                more = w.shared[1] - n
            else:
                more = remote.answer(w.request.request_id, st.keys, n)   # as the admission asks
                if more is None:
                    return None
                w.shared = (n, n + more)
            more = min(more, useful - n)
            tiers = tuple(tiers) + ("shared",) * more
            n += more
        return list(st.keys[:n]), tuple(tiers[:n])
