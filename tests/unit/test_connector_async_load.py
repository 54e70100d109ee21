"""Asynchronous shared-tier loads do not compete with the engine's loop: "ask again" answers come
from the request's cached local lookup, the chunks of a plan are read in parallel (in request
order into the blocks, promoted in order), and an idle step waits for a load instead of spinning."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvtier.chunk import ChunkMeta
from kvtier.integrations.vllm import scheduler_side, worker_side
from kvtier.keys import chunk_keys
from tests.unit.fake_tiers import DictSharedTier
from kvtier.config import SharedFsConfig, StoreConfig
from kvtier.metrics import Telemetry
from kvtier.store import TieredStore
from kvtier.tiers.guard import GuardedTier
from kvtier.tiers.registry import open_tiers
from tests.unit.test_connector_shared import _fill_shared, _sched, _worker, wait_for
from tests.unit.test_connector_sides import NS, FakeRequest, _kv, _prompt


def _store(tmp: Path, shared: DictSharedTier) -> TieredStore:
    """RAM + the shared tier behind its guard, with deadlines no stall in these tests reaches."""
    cfg = StoreConfig.model_validate({"chunk_size": 256, "memory": {"capacity": "64MiB"}})
    tm = Telemetry()
    guarded = GuardedTier.wrap(shared, SharedFsConfig(path=tmp, lookup_timeout_s=60, io_timeout_s=60,
                                                      max_inflight=2, probe_interval_s=0.05), tm)
    return TieredStore.from_tiers(cfg, NS, open_tiers(cfg, NS, tm) + [guarded], tm)


class CountingLookups:
    """Counts the store's local lookups (the scheduler's per-step work)."""

    def __init__(self, store) -> None:
        self.n = 0
        self._lookup = store.lookup

        def lookup(keys, deadline=None):
            self.n += 1
            return self._lookup(keys, deadline)
        store.lookup = lookup


class ConcurrentReads(DictSharedTier):
    """A shared tier whose first read waits (up to 10 s) until a second read is in flight at the same
    time: a loader reading one chunk at a time fails that first read by its deadline."""

    def __init__(self, data) -> None:
        super().__init__()
        self.data = data
        self.inflight = 0
        self.max_inflight = 0
        self.second = threading.Event()
        self.first_waited_ok: bool | None = None

    def read_into(self, keys, outs, deadline, *, lent=False):
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            first = self.first_waited_ok is None
            if first:
                self.first_waited_ok = False
            if self.inflight >= 2:
                self.second.set()
        try:
            if first:
                self.first_waited_ok = self.second.wait(10)
                if not self.first_waited_ok:
                    raise ConnectionError("no second read came while the first was in flight")
            return super().read_into(keys, outs, deadline, lent=lent)
        finally:
            with self.lock:
                self.inflight -= 1


def _admit_async(s, tables, req):
    assert wait_for(lambda: s.num_new_matched_tokens(req, 0) is not None)
    claim = s.num_new_matched_tokens(req, 0)
    assert claim and s.load_async(req)
    s.after_alloc(req, claim)
    tables.alloc(req.request_id, claim)
    return claim


def test_asking_again_while_the_shared_answer_is_pending_does_no_store_lookup(tmp_path: Path) -> None:
    tokens = _prompt(1100)
    shared, _ = _fill_shared(tmp_path, tokens, _kv(seed=11))
    shared.stall()
    with _store(tmp_path / "b", shared) as b:
        s, _ = _sched(b, timeout=60)
        counted = CountingLookups(b)
        req = FakeRequest("r", tokens)
        for _ in range(50):                        # 50 engine steps while the answer is pending
            assert s.num_new_matched_tokens(req, 0) is None
        assert counted.n == 1                      # one local lookup per request, not per step
        shared.resume()
        assert wait_for(lambda: s.num_new_matched_tokens(req, 0) is not None)
        assert s.num_new_matched_tokens(req, 0) == 1024 and s.load_async(req)
        assert s.hit_tiers(req, 1024) == {"shared": 1024}
        s.close()


def test_async_plan_reads_chunks_in_parallel_copies_and_promotes_in_order(tmp_path: Path) -> None:
    tokens = _prompt(1100)
    kv = _kv(seed=12)
    filled, src = _fill_shared(tmp_path, tokens, kv)
    shared = ConcurrentReads(filled.data)
    # two processes' stores ("EngineCore" and "worker"): the worker's store never saw the scheduler's
    # existence answer, so its promotions rely on the loader's order (a chunk's parent first)
    with _store(tmp_path / "sched", shared) as sb, _store(tmp_path / "work", shared) as wb:
        s, tables = _sched(sb)
        req = FakeRequest("r", tokens)
        claim = _admit_async(s, tables, req)
        meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
        dst = {k: torch.zeros_like(v) for k, v in kv.items()}
        w = _worker(wb, dst, timeout=30)
        w.load(meta)
        got: set[str] = set()
        assert wait_for(lambda: got.update(w.get_finished(set())) or "r" in got, 30)
        assert shared.first_waited_ok is True and shared.max_inflight == worker_side.PREFETCH_DEPTH
        assert w.take_load_errors() == set()
        assert w.take_worker_meta().loads["r"].loaded_tokens == claim == 1024      # claimed == loaded
        for name in kv:
            for i in range(8):
                assert torch.equal(dst[name][tables("r")[i]], kv[name][src[i]])
        assert wb.lookup(chunk_keys(NS, tokens)).num_chunks == 4                  # all four promoted
        w.close()
        s.close()


def test_a_failed_chunk_fails_the_rest_and_later_reads_never_touch_the_next_plan(tmp_path: Path) -> None:
    tokens = _prompt(1100)
    kv = _kv(seed=13)
    shared, src = _fill_shared(tmp_path, tokens, kv)
    with _store(tmp_path / "b", shared) as b:
        s, tables = _sched(b)
        req = FakeRequest("r", tokens)
        _admit_async(s, tables, req)
        keys = chunk_keys(NS, tokens)
        del shared.data[keys[1]]                    # deleted by "another machine" after the lookup
        meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
        dst = {k: torch.zeros_like(v) for k, v in kv.items()}
        w = _worker(b, dst)
        w.load(meta)
        got: set[str] = set()
        assert wait_for(lambda: got.update(w.get_finished(set())) or "r" in got)
        assert w.take_load_errors() == set(tables("r")[2:8])      # chunks 1..3: vLLM recomputes them
        o = w.take_worker_meta().loads["r"]
        assert (o.loaded_tokens, o.failed_tokens) == (256, 768)
        for name in kv:                                          # chunk 0 is exact
            for i in range(2):
                assert torch.equal(dst[name][tables("r")[i]], kv[name][src[i]])
        w.close()
        s.close()


def test_idle_step_waits_for_the_load_busy_step_never_waits(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(worker_side, "IDLE_WAIT_S", 60.0)   # long: only a finished load ends the wait
    tokens = _prompt(1100)
    kv = _kv(seed=14)
    shared, src = _fill_shared(tmp_path, tokens, kv)
    with _store(tmp_path / "b", shared) as b:
        s, tables = _sched(b)
        req = FakeRequest("r", tokens)
        _admit_async(s, tables, req)
        meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
        assert meta.idle                               # nothing scheduled, a load in flight
        assert not s.build_meta(SimpleNamespace(num_scheduled_tokens={"other": 5})).idle
        shared.stall()
        w = _worker(b, {k: torch.zeros_like(v) for k, v in kv.items()})
        w.load(meta)
        assert w.get_finished(set(), idle=False) == set()      # tokens scheduled: returns while stalled
        timer = threading.Timer(0.2, shared.resume)
        timer.start()
        assert w.get_finished(set(), idle=True) == {"r"}       # one call: it waited for the load
        assert w.take_load_errors() == set()
        assert w.take_worker_meta().loads["r"].loaded_tokens == 1024
        timer.join()
        w.close()
        s.close()


def test_idle_scheduler_step_waits_for_a_pending_shared_answer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(scheduler_side, "IDLE_WAIT_S", 60.0)
    tokens = _prompt(1100)
    shared, _ = _fill_shared(tmp_path, tokens, _kv(seed=15))
    shared.stall()
    with _store(tmp_path / "b", shared) as b:
        s, _ = _sched(b, timeout=60)
        req = FakeRequest("r", tokens)
        assert s.num_new_matched_tokens(req, 0) is None
        timer = threading.Timer(0.2, shared.resume)
        timer.start()
        s.build_meta(SimpleNamespace(num_scheduled_tokens={}))      # waits for the answer
        assert s.num_new_matched_tokens(req, 0) == 1024            # here at the next step
        timer.join()
        s.close()


def test_store_promote_keeps_the_parent_rule(tmp_path: Path) -> None:
    """``TieredStore.promote``: a chunk whose parent is nowhere (local or seen shared) is not promoted."""
    shared = DictSharedTier()
    with _store(tmp_path, shared) as st:
        keys = chunk_keys(NS, _prompt(600))
        payload = bytes(range(256)) * 4
        st.promote(ChunkMeta(keys[1], keys[0], 256, (1024,), "uint8", len(payload)), payload)
        assert st.where(keys[1]) is None
        st.promote(ChunkMeta(keys[0], None, 256, (1024,), "uint8", len(payload)), payload)
        st.promote(ChunkMeta(keys[1], keys[0], 256, (1024,), "uint8", len(payload)), payload)
        assert st.where(keys[0]) == "memory" and st.where(keys[1]) == "memory"


class _IdleRecorder:
    """A worker half that records the ``idle`` flag each ``get_finished`` was called with."""

    def __init__(self) -> None:
        self.idle: list[bool] = []

    def get_finished(self, finished_req_ids, idle: bool = False):
        self.idle.append(idle)
        return set()

    def take_released(self):
        return set()

    def step_bound(self, meta) -> None:
        pass


def test_connector_hands_the_steps_idle_flag_to_the_worker() -> None:
    """vLLM binds the step's metadata around ``get_finished``; the connector must pass its ``idle``
    on, else the worker never waits and an engine whose only request waits for shared-tier KV
    steps again at once (its worker's main thread then spins on the engine's core beside the
    loader's threads). The flag must also survive the trip to a worker process (pickle)."""
    import pickle

    import pytest

    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata

    c = object.__new__(KvtierConnector)       # the worker half only: no engine needed
    c._connector_metadata = None
    c._worker = rec = _IdleRecorder()
    c._prefetch = None                                           # no queue-time prefetch
    c.get_finished(set())                                       # no metadata bound: not idle
    for idle in (True, False):
        c.bind_connector_metadata(pickle.loads(pickle.dumps(KvtierConnectorMetadata(idle=idle))))
        c.get_finished(set())
        c.clear_connector_metadata()
    assert rec.idle == [False, True, False]


def test_a_failed_lent_read_never_writes_into_the_next_plans_ring() -> None:
    """The loader lends its ring buffers to the store (``read_into(lent=True)``): a read that failed
    may still be written by a backend thread after it returned. The next plan must then read into
    fresh buffers, so that late write can never reach a block of another request."""
    from kvtier.integrations.vllm.async_loads import AsyncLoader
    from kvtier.integrations.vllm.metadata import LoadChunk, LoadPlan

    late: list[bytearray] = []
    release = threading.Event()

    def read(key, buf, deadline):
        if key == b"bad":                     # fails now, and "the backend" writes 0xEE into it later
            late.append(buf)
            threading.Thread(target=lambda: (release.wait(10), buf.__setitem__(slice(None), b"\xee" * 8))).start()
            return False, "timeout", None
        buf[:] = key.ljust(8, b".")
        return True, None, None

    scattered: list[bytes] = []
    gate = threading.Event()

    def scatter(block_ids, first, buf):
        if block_ids == (2,):
            release.set()                     # the late write happens while plan 2 holds its buffer
            time.sleep(0.2)
        scattered.append(bytes(buf))
        gate.set()

    loader = AsyncLoader(read, scatter, lambda: bytearray(8), block_size=1, load_timeout_s=5, depth=1)
    loader.submit(LoadPlan("a", 0, 1, (LoadChunk(b"bad", (1,)),), async_load=True))
    assert loader.wait_idle(10)
    loader.submit(LoadPlan("b", 0, 1, (LoadChunk(b"good", (2,)),), async_load=True))
    assert loader.wait_idle(10)
    loader.close()
    assert scattered == [b"good...."]
    assert loader.rings_dropped == 1 and all(late[0] is not b for b in loader.buffers)
