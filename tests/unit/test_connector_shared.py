"""The engine never waits on a shared tier: 'ask again' while the existence answer is pending,
bounded by the lookup timeout; asynchronous loads of shared-tier chunks reported through
get_finished; TP aggregation of worker reports (a key is available only where every rank has it)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvtier.config import SharedFsConfig, StoreConfig
from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata, LoadOutcome
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.keys import chunk_keys
from kvtier.metrics import Telemetry
from kvtier.store import TieredStore
from kvtier.tiers.guard import GuardedTier
from kvtier.tiers.registry import open_tiers
from tests.unit.fake_tiers import DictSharedTier
from tests.unit.test_connector_sides import BLOCK, CHUNK, LBHNC, NS, FakeRequest, Tables, _kv, _prompt


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def _store(tmp: Path, shared: DictSharedTier, mem: bool = True) -> TieredStore:
    cfg = StoreConfig.model_validate({"chunk_size": CHUNK, "memory": {"enabled": mem, "capacity": "64MiB"}})
    tm = Telemetry()
    # generous caps: they bound healthy calls too (a niced run beside busy cores); the tests that need a
    # short bound give it to the scheduler (_sched) or the worker (_worker)
    guarded = GuardedTier.wrap(shared, SharedFsConfig(path=tmp, lookup_timeout_s=30, io_timeout_s=30,
                                                      max_inflight=2, probe_interval_s=0.05), tm)
    return TieredStore.from_tiers(cfg, NS, open_tiers(cfg, NS, tm) + [guarded], tm)


def _sched(store, timeout: float = 30):
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, shared_lookup_timeout_s=timeout)
    tables = Tables()
    s.bind(tables.per_group)
    return s, tables


def _worker(store, kv, timeout: float = 5.0) -> WorkerSide:
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=timeout)
    w.register(kv)
    assert w.disabled is None
    return w


def _fill_shared(tmp: Path, tokens, kv) -> tuple[DictSharedTier, list[int]]:
    """'Machine A' computes the prompt and saves it: its chunks reach the shared tier."""
    shared = DictSharedTier()
    with _store(tmp / "a", shared) as a:
        s, tables = _sched(a)
        req = FakeRequest("src", tokens)
        assert wait_for(lambda: s.num_new_matched_tokens(req, 0) == 0)   # the shared tier answered: a miss
        s.after_alloc(req, 0)
        tables.alloc("src", len(tokens))
        w = _worker(a, kv)
        w.save(s.build_meta(SimpleNamespace(num_scheduled_tokens={"src": len(tokens)})))
        assert a.flush(10)
        w.close()
        return shared, tables("src")


def test_shared_hit_asks_again_then_loads_asynchronously_and_exactly(tmp_path: Path) -> None:
    tokens = _prompt(1100)
    kv = _kv(seed=7)
    shared, src = _fill_shared(tmp_path, tokens, kv)
    assert len(shared.data) == 4
    shared.stall()                                       # the answer is pending while it is stalled
    with _store(tmp_path / "b", shared) as b:            # "machine B": empty local tiers
        s, tables = _sched(b, timeout=30)
        req = FakeRequest("r", tokens)
        assert s.num_new_matched_tokens(req, 0) is None  # ask again: no waiting on the loop
        assert s.num_new_matched_tokens(req, 0) is None
        shared.resume()
        assert wait_for(lambda: s.num_new_matched_tokens(req, 0) is not None)
        claim = s.num_new_matched_tokens(req, 0)
        assert claim == 1024 and s.load_async(req)
        s.after_alloc(req, claim)
        tables.alloc("r", claim)
        meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
        (plan,) = meta.loads
        assert plan.async_load
        assert s.finished(FakeRequest("r", tokens)) is True        # blocks must stay while it loads
        dst = {k: torch.zeros_like(v) for k, v in kv.items()}
        w = _worker(b, dst)
        w.load(meta)
        got: set[str] = set()
        assert wait_for(lambda: got.update(w.get_finished(set())) or "r" in got)
        assert w.take_load_errors() == set()
        for name in kv:
            for i in range(8):
                assert torch.equal(dst[name][tables("r")[i]], kv[name][src[i]])
        assert w.take_worker_meta().loads["r"].loaded_tokens == 1024
        s.on_finished_recving({"r"})
        assert s.finished(FakeRequest("r", tokens)) is False
        assert b.flush(10) and b.lookup(chunk_keys(NS, tokens)).num_chunks == 4   # promoted locally
        w.close()
        s.close()


def test_lookup_timeout_proceeds_without_the_shared_tier(tmp_path: Path) -> None:
    tokens = _prompt(800)
    shared, _ = _fill_shared(tmp_path, tokens, _kv(seed=8))
    shared.stall()
    with _store(tmp_path / "b", shared) as b:
        s, _ = _sched(b, timeout=0.2)
        req = FakeRequest("r", tokens)
        t0 = time.monotonic()
        answers = []
        while True:
            a = s.num_new_matched_tokens(req, 0)
            answers.append(a)
            if a is not None:
                break
            time.sleep(0.01)
        assert answers[0] is None and answers[-1] == 0 and not s.load_async(req)
        assert time.monotonic() - t0 < 10
        assert s.num_new_matched_tokens(req, 0) == 0      # cached for the request
        shared.resume()
        s.close()


def test_stalled_async_load_fails_by_its_deadline_and_reports_blocks(tmp_path: Path) -> None:
    tokens = _prompt(800)
    kv = _kv(seed=9)
    shared, _ = _fill_shared(tmp_path, tokens, kv)
    with _store(tmp_path / "b", shared) as b:
        s, tables = _sched(b)
        req = FakeRequest("r", tokens)
        assert wait_for(lambda: s.num_new_matched_tokens(req, 0) is not None)
        claim = s.num_new_matched_tokens(req, 0)
        assert claim == 768 and s.load_async(req)
        s.after_alloc(req, claim)
        tables.alloc("r", claim)
        meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
        shared.stall()                                   # stalls between lookup and load
        w = _worker(b, {k: torch.zeros_like(v) for k, v in kv.items()}, timeout=0.5)
        w.load(meta)                                     # returns at once: the load is asynchronous
        got: set[str] = set()
        assert wait_for(lambda: got.update(w.get_finished(set())) or "r" in got)
        assert w.take_load_errors() == set(tables("r")[:6])   # every block: vLLM recomputes them
        wm = w.take_worker_meta()
        o = wm.loads["r"]
        assert o.loaded_tokens == 0 and o.failed_tokens == 768
        s.on_worker_meta(wm)                             # vLLM then retries the request from scratch:
        assert s.num_new_matched_tokens(req, 0) == 0     # it recomputes instead of waiting on the tier again
        shared.resume()
        w.close()
        s.close()


def test_tp_aggregation_a_key_is_available_only_where_every_rank_stored_it() -> None:
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    r0 = KvtierWorkerMetadata(1, {"x": LoadOutcome(512, 0)}, [a, b, c], [], ["memory", "memory", "disk"], [d])
    r1 = KvtierWorkerMetadata(2, {"x": LoadOutcome(256, 256, "miss")}, [b, c, d], [a], ["disk", "disk", "disk"], [])
    agg = r0.aggregate(r1)
    assert agg.stored_keys == [b, c]                       # intersection
    assert agg.tier_of() == {b: "memory", c: "disk"}
    assert set(agg.evicted_keys) == {d} and set(agg.missing_keys) == {a}   # unions
    assert (agg.loads["x"].loaded_tokens, agg.loads["x"].failed_tokens) == (256, 256)   # min of loads
    empty = KvtierWorkerMetadata(3)
    assert r0.aggregate(empty).stored_keys == []           # a rank that stored nothing: nothing is available
    s = SchedulerSide(SimpleNamespace(has_remote=lambda: False), NS, block_size=BLOCK, save=True,
                      min_hit_chunks=1, worker_key_capacity=100)
    s.on_worker_meta(agg)
    assert b in s.directory and c in s.directory and a not in s.directory and d not in s.directory


def test_worker_reports_ram_evictions_and_always_reports_under_tp(tmp_path: Path) -> None:
    cfg = StoreConfig.model_validate({"chunk_size": CHUNK, "memory": {"capacity": 3 * 2 * 3 * 2 * 128 * 16 * 4}})
    kv = _kv(seed=10)
    with TieredStore.open(cfg, NS) as store:
        w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5, always_report=True)
        w.register(kv)
        assert w.take_worker_meta() is not None           # TP>1: a report every step, even empty
        s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1)
        tables = Tables()
        s.bind(tables.per_group)
        stored: list[bytes] = []
        evicted: list[bytes] = []
        for i in range(4):                                # 4 one-chunk prompts, RAM holds 3
            req = FakeRequest(f"q{i}", _prompt(300, seed=20 + i))
            s.num_new_matched_tokens(req, 0)
            s.after_alloc(req, 0)
            tables.alloc(req.request_id, 300)
            w.save(s.build_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: 300})))
            m = w.take_worker_meta()
            stored += m.stored_keys
            evicted += m.evicted_keys
        assert len(stored) == 4 and len(evicted) == 1 and evicted[0] in stored
        assert store.where(evicted[0]) is None
        w.close()
