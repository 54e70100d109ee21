"""Queue-time prefetch: waiting requests' chunks planned in queue order within the RAM budget, the budget
released at admission / finish, cancels, the shared tier asked once; the worker's reader copies chunks
up in order and stops at the first failure; end to end (no vLLM) a waiting request's shared-tier chunks
land in RAM and its claim is then a synchronous RAM load of the exact bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvtier.integrations.vllm.metadata import (KvtierConnectorMetadata, KvtierWorkerMetadata, PrefetchOutcome,
                                               PrefetchPlan)
from kvtier.integrations.vllm.prefetch import QueuePrefetch
from kvtier.integrations.vllm.prefetch_reads import PrefetchReader
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.keys import chunk_keys
from kvtier.tiers.protocol import ReadResult, Status
from tests.unit.test_connector_shared import _fill_shared, _store, _worker, wait_for
from tests.unit.test_connector_sides import BLOCK, CHUNK, NS, FakeRequest, Tables, _kv, _prompt

NB = 1000          # chunk bytes in the pure tests


@dataclass
class FakeView:
    """The scheduler half as the prefetch sees it: keys per request, tiers per chunk, no shared tier."""

    by_first: dict[bytes, tuple[str, ...]] = field(default_factory=dict)
    _remote: object = None

    def _state(self, request):
        return SimpleNamespace(keys=chunk_keys(NS, request.prompt_token_ids), remote_failed=False)

    def _available_chunks(self, keys):
        t = self.by_first.get(bytes(keys[0]), ()) if keys else ()
        return len(t[:len(keys)]), t[:len(keys)]

    def add(self, req: FakeRequest, tiers: tuple[str, ...]) -> None:
        self.by_first[bytes(chunk_keys(NS, req.prompt_token_ids)[0])] = tiers


def _req(name: str, chunks: int, seed: int) -> FakeRequest:
    return FakeRequest(name, _prompt(chunks * CHUNK + 1, seed=seed))


def _qp(budget_chunks: int) -> QueuePrefetch:
    return QueuePrefetch(budget_chunks * NB, NB, block_size=BLOCK, chunk_size=CHUNK)


def test_plans_in_queue_order_within_the_budget_and_releases_it() -> None:
    view, qp = FakeView(), _qp(5)
    a, b, c = _req("a", 3, 1), _req("b", 4, 2), _req("c", 1, 3)
    view.add(a, ("disk", "shared", "shared"))
    view.add(b, ("memory", "shared", "shared", "shared"))
    view.add(c, ("shared",))
    for r in (a, b, c):
        qp.arrived(r, view)
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    # a: 3 chunks; b: its RAM chunk is skipped, 2 of its 3 others fit; c: no room left, it waits
    assert [(p.req_id, len(p.keys)) for p in meta.prefetches] == [("a", 3), ("b", 2)]
    assert meta.prefetches[1].tiers == ("shared", "shared")
    assert qp.used == 5 * NB
    qp.admitted("a")                                    # a leaves the queue: its 3 chunks' room is free
    assert qp.used == 2 * NB
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    assert [p.req_id for p in meta.prefetches] == ["c"] and meta.prefetch_cancels == ["a"]   # a was late
    qp.finished("b")
    qp.finished("c")
    assert qp.used == 0
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    assert sorted(meta.prefetch_cancels) == ["b", "c"] and not meta.prefetches


def test_no_overtaking_and_nothing_for_chunks_in_ram() -> None:
    view, qp = FakeView(), _qp(2)
    head, small, resident = _req("head", 3, 1), _req("small", 1, 2), _req("res", 2, 3)
    view.add(head, ("shared", "shared", "shared"))
    view.add(small, ("shared",))
    view.add(resident, ("memory", "memory"))
    qp.arrived(resident, view)
    qp.arrived(head, view)
    qp.arrived(small, view)
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    assert [(p.req_id, len(p.keys)) for p in meta.prefetches] == [("head", 2)]   # the leading two fit
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    assert not meta.prefetches                          # small waits behind the head: no room
    qp.on_done({"head": PrefetchOutcome(fetched=2)})
    qp.admitted("head")                                 # done before admission: nothing to cancel
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    assert [p.req_id for p in meta.prefetches] == ["small"] and not meta.prefetch_cancels


def test_admitted_before_arrival_step_is_never_planned() -> None:
    view, qp = FakeView(), _qp(8)
    r = _req("r", 2, 1)
    view.add(r, ("shared", "shared"))
    qp.arrived(r, view)
    qp.admitted("r")                   # scheduled in the step it arrived: no wait, no prefetch
    meta = KvtierConnectorMetadata()
    qp.step(meta, view)
    assert not meta.prefetches and not meta.prefetch_cancels and qp.used == 0


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["arrive", "admit", "finish", "step", "done"]),
                          hs.integers(0, 5), hs.integers(1, 4)), max_size=40), hs.integers(0, 6))
def test_budget_is_never_exceeded(ops, budget_chunks) -> None:
    view, qp = FakeView(), _qp(budget_chunks)
    waiting: set[str] = set()
    planned: dict[str, int] = {}
    for op, i, n in ops:
        rid = f"r{i}"
        if op == "arrive" and rid not in waiting and rid not in planned:
            r = _req(rid, n, i)
            view.add(r, ("shared",) * n)
            qp.arrived(r, view)
            waiting.add(rid)
        elif op == "admit":
            qp.admitted(rid)
            waiting.discard(rid)
        elif op == "finish":
            qp.finished(rid)
            waiting.discard(rid)
        elif op == "done":
            qp.on_done({rid: PrefetchOutcome(fetched=1)})
        else:
            meta = KvtierConnectorMetadata()
            qp.step(meta, view)
            for p in meta.prefetches:
                assert p.req_id in waiting and p.req_id not in planned
                planned[p.req_id] = len(p.keys)
        assert 0 <= qp.used <= qp.budget
        assert qp.used == sum(planned[r] for r in waiting if r in planned) * NB


# -- the worker's reader -----------------------------------------------------------------------------
class ReadStore:
    """Reads answer from ``results`` (key -> status); ``where`` from ``top``."""

    def __init__(self, results: dict[bytes, Status], top: set[bytes] = frozenset()) -> None:
        self.results, self.top, self.read = results, set(top), []

    def where(self, key):
        return "memory" if key in self.top else None

    def read_into(self, keys, outs, deadline=None, *, promote=None, local_only=False, lent=False):
        assert promote is True and not local_only
        (k,) = keys
        self.read.append(k)
        st = self.results.get(k, Status.MISS)
        if st is Status.HIT:
            self.top.add(k)
            return [ReadResult(Status.HIT, meta=SimpleNamespace(payload_len=len(outs[0])))]
        return [ReadResult(st)]


def test_reader_copies_in_order_skips_resident_and_stops_at_a_failure() -> None:
    keys = [bytes([i]) * 4 for i in range(5)]
    store = ReadStore({keys[0]: Status.HIT, keys[2]: Status.HIT, keys[3]: Status.UNAVAILABLE,
                       keys[4]: Status.HIT}, top={keys[1]})
    out = PrefetchReader(store, chunk_nbytes=lambda: 64).run_plan(PrefetchPlan("r", tuple(keys)))
    assert (out.fetched, out.resident, out.failed, out.error) == (2, 1, 2, "unavailable")
    assert store.read == [keys[0], keys[2], keys[3]]     # never past the failed chunk


def test_reader_cancels_queued_and_running_plans() -> None:
    keys = tuple(bytes([i]) * 4 for i in range(3))
    reader = PrefetchReader(ReadStore({k: Status.HIT for k in keys}), chunk_nbytes=lambda: 64)
    reader._thread = object()           # not started: plans stay queued
    reader.step(KvtierConnectorMetadata(prefetches=[PrefetchPlan("a", keys), PrefetchPlan("b", keys)]))
    reader.step(KvtierConnectorMetadata(prefetch_cancels=["a"]))
    assert reader.take_done() == {"a": PrefetchOutcome(cancelled=3)} and reader.pending() == 1
    reader.step(KvtierConnectorMetadata(prefetch_cancels=["b2"]))     # unknown or running: stops it
    assert reader.run_plan(PrefetchPlan("b2", keys)).cancelled == 3
    assert PrefetchReader(ReadStore({}), chunk_nbytes=lambda: 0).run_plan(PrefetchPlan("c", keys)).error == "disabled"


def test_worker_reports_fold_prefetch_outcomes() -> None:
    a = KvtierWorkerMetadata(1, prefetched={"x": PrefetchOutcome(fetched=2)})
    b = KvtierWorkerMetadata(1, prefetched={"y": PrefetchOutcome(failed=1)})
    assert set(a.aggregate(b).prefetched) == {"x", "y"}


# -- end to end: scheduler half, reader, store, worker load (no vLLM) ---------------------------------
def _sched(store, chunk_nbytes: int, budget: int):
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, shared_lookup_timeout_s=30,
                      chunk_nbytes=chunk_nbytes, prefetch_ram=budget)
    tables = Tables()
    s.bind(tables.per_group)
    return s, tables


IDLE = SimpleNamespace(num_scheduled_tokens={})


def _first_plan(s: SchedulerSide) -> KvtierConnectorMetadata:
    box: list[KvtierConnectorMetadata] = []

    def planned() -> bool:
        m = s.build_meta(IDLE)
        box.append(m)
        return bool(m.prefetches)
    assert wait_for(planned)
    return box[-1]


def test_waiting_request_loads_from_ram_after_prefetch(tmp_path: Path) -> None:
    tokens = _prompt(1100)
    kv = _kv(seed=11)
    shared, src = _fill_shared(tmp_path, tokens, kv)
    with _store(tmp_path / "b", shared) as b:            # "machine B": empty local tiers
        dst = {k: torch.zeros_like(v) for k, v in kv.items()}
        w = _worker(b, dst)
        s, tables = _sched(b, w.chunk_nbytes, budget=8 * w.chunk_nbytes)
        reader = PrefetchReader(b, chunk_nbytes=lambda: w.chunk_nbytes)
        req = FakeRequest("r", tokens)
        shared.stall()
        s.on_new_request(req)                            # arrives; the engine is busy: it waits
        assert s.num_new_matched_tokens(req, 0) is None  # looked at once while the answer is pending
        shared.resume()
        meta = _first_plan(s)
        (plan,) = meta.prefetches
        assert plan.tiers == ("shared",) * 4
        reader.step(meta)
        assert wait_for(lambda: reader.pending() == 0 and b.lookup(chunk_keys(NS, tokens)).num_chunks == 4)
        done: dict = {}
        assert wait_for(lambda: done.update(reader.take_done()) or "r" in done)
        assert done["r"].fetched == 4 and not done["r"].failed
        s.on_worker_meta(KvtierWorkerMetadata(os.getpid(), prefetched=done))
        assert b.lookup(chunk_keys(NS, tokens)).tiers == ("memory",) * 4
        calls = shared.calls
        claim = s.num_new_matched_tokens(req, 0)         # scheduled now: every chunk in RAM
        assert claim == 1024 and not s.load_async(req)
        assert shared.calls == calls                     # the shared tier was not asked again
        s.after_alloc(req, claim)
        tables.alloc("r", len(tokens))
        meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={"r": len(tokens) - claim}))
        (load,) = meta.loads
        assert not load.async_load and not meta.prefetch_cancels
        w.load(meta)
        assert w.take_load_errors() == set()
        for name in kv:
            for i in range(8):
                assert torch.equal(dst[name][tables("r")[i]], kv[name][src[i]])
        reader.close()
        w.close()
        s.close()


def test_abort_while_waiting_cancels_the_running_prefetch(tmp_path: Path) -> None:
    tokens = _prompt(1100)
    kv = _kv(seed=12)
    shared, _ = _fill_shared(tmp_path, tokens, kv)
    with _store(tmp_path / "b", shared) as b:
        w = _worker(b, {k: torch.zeros_like(v) for k, v in kv.items()})
        s, _ = _sched(b, w.chunk_nbytes, budget=8 * w.chunk_nbytes)
        reader = PrefetchReader(b, chunk_nbytes=lambda: w.chunk_nbytes)
        req = FakeRequest("r", tokens)
        s.on_new_request(req)
        meta = _first_plan(s)
        shared.stall()                                   # the first read blocks in the shared tier
        reader.step(meta)
        assert wait_for(lambda: shared.blocked >= 1)
        assert s.finished(req) is False                  # aborted while waiting
        cancel = s.build_meta(IDLE)
        assert cancel.prefetch_cancels == ["r"] and s.prefetch.used == 0
        reader.step(cancel)
        shared.resume()
        done: dict = {}
        assert wait_for(lambda: done.update(reader.take_done()) or "r" in done)
        assert done["r"].fetched == 1 and done["r"].cancelled == 3
        reader.close()
        w.close()
        s.close()
