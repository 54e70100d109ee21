"""kvtier's secondary tier for vLLM's native offloading, on the SSD tier, with vLLM's own classes:
built by ``SecondaryTierFactory`` from a module path, driven with real ``OffloadKey``s and
``TransferJob``s over a primary region of real bytes, and through vLLM's ``TieringOffloadingManager``
(its CPU primary tier in a ``SharedOffloadRegion``). Shared backends: tests/integration/test_vllm_tiering_backends.py."""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtier.config import ConfigError
from kvtier.integrations.vllm_tiering import KvtierSecondaryTier
from tests.unit import vllm_tiering_rig as rig

REQ = ReqContext(req_id="r0")
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


class HeldExecutor(Executor):
    """Runs submitted work only when told (a job stays in flight as long as a test needs)."""

    def __init__(self) -> None:
        self.queued: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        fut: Future = Future()
        self.queued.append((fut, fn, args))
        return fut

    def run_all(self) -> None:
        queued, self.queued = self.queued, []
        for fut, fn, args in queued:
            fut.set_result(fn(*args))  # type: ignore[operator]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.run_all()


@pytest.fixture
def disk_tier(tmp_path: Path):
    tier, arr = rig.build_tier(rig.disk_entry(tmp_path / "ssd"))
    yield tier, arr
    tier.shutdown()


def _chunk_file(root: Path, tier: KvtierSecondaryTier, key: bytes) -> Path:
    return next(root.rglob(tier.keymap.chunk_key(key).hex() + "*"))


def test_the_factory_loads_the_tier_by_module_path(tmp_path):
    e = rig.disk_entry(tmp_path / "ssd")
    assert SecondaryTierFactory.get_tier_class(e) is KvtierSecondaryTier
    tier, _ = rig.build_tier(e)
    try:
        assert isinstance(tier, KvtierSecondaryTier) and tier.tier_type == rig.TIER_TYPE
        assert tier.medium is Medium.STORAGE and tier.block_size_bytes == 64 * 1024
        assert tier._store is None                      # nothing opened before the first call
        assert [t.name for t in tier.store.tiers] == ["disk"]   # no RAM tier: vLLM's primary is the RAM
    finally:
        tier.shutdown()


@pytest.mark.parametrize("fields, words", [
    ({"kvtier_config": {"store": {"memory": {"capacity": "1GiB"}}}}, "store.disk"),
    ({"kvtier_config": {"store": {"disk": {"enabled": True}}}}, "store.disk.path"),
    ({"kvtier_config": {"store": {"nope": 1}}}, "store.nope"),
    ({"kvtier_config": "store: {}"}, "mapping"),
    ({"locality": "MARS"}, "locality"),
    ({"job_threads": 0}, "job_threads"),
    ({"kvtier_config_file": "/nonexistent/kvtier.yaml"}, "not found"),
])
def test_a_bad_configuration_is_one_line_naming_it(tmp_path, fields, words):
    with pytest.raises(ConfigError) as err:
        rig.build_tier({**rig.disk_entry(tmp_path / "ssd"), **fields})
    msg = str(err.value)
    assert words in msg and "\n" not in msg


def test_store_then_hit_then_load_into_other_slots_bytes_identical(disk_tier):
    tier, arr = disk_tier
    ks = rig.keys(6, seed=1)
    data = rig.fill(arr, range(6), seed=2)
    assert [tier.lookup(k, REQ) for k in ks] == [LookupResult.MISS] * 6
    tier.submit_store(rig.job(1, ks, list(range(6)), promotion=False))
    [res] = rig.finished(tier)
    assert (res.job_id, res.success, res.transfer_bytes) == (1, True, 6 * 64 * 1024)
    assert [tier.lookup(k, REQ) for k in ks] == [LookupResult.HIT] * 6
    arr[10:16] = 0
    tier.submit_load(rig.job(2, ks[::-1], list(range(10, 16)), promotion=True))
    [res] = rig.finished(tier)
    assert res.success and res.successful_keys is None
    assert [arr[10 + i].tobytes() for i in range(6)] == data[::-1]
    assert list(tier.get_finished_jobs()) == []        # each job is reported once


def test_retry_while_a_job_holds_the_key_and_each_job_reported_once(disk_tier):
    tier, arr = disk_tier
    held = HeldExecutor()
    tier.jobs.use_executor(held)
    ks = rig.keys(2, seed=3)
    rig.fill(arr, [0, 1], seed=4)
    tier.submit_store(rig.job(7, ks, [0, 1], promotion=False))
    assert tier.has_pending_work()
    assert [tier.lookup(k, REQ) for k in ks] == [LookupResult.RETRY] * 2
    assert list(tier.get_finished_jobs()) == []
    held.run_all()                                      # done, not yet reported: still in flight
    assert tier.lookup(ks[0], REQ) is LookupResult.RETRY
    [res] = tier.get_finished_jobs()
    assert res.job_id == 7 and res.success
    assert list(tier.get_finished_jobs()) == []
    assert not tier.has_pending_work()
    assert [tier.lookup(k, REQ) for k in ks] == [LookupResult.HIT] * 2
    tier.submit_load(rig.job(8, ks, [5, 6], promotion=True))
    assert tier.lookup(ks[1], REQ) is LookupResult.RETRY
    held.run_all()
    assert [r.job_id for r in tier.get_finished_jobs()] == [8]


@pytest.mark.parametrize("damage", ["flip_payload_byte", "other_keys_chunk", "truncate"])
def test_a_damaged_chunk_is_a_failed_job_never_wrong_bytes(tmp_path, damage):
    tier, arr = rig.build_tier(rig.disk_entry(tmp_path / "ssd"))
    try:
        ks = rig.keys(3, seed=5)
        data = rig.fill(arr, [0, 1, 2], seed=6)
        tier.submit_store(rig.job(1, ks, [0, 1, 2], promotion=False))
        assert rig.finished(tier)[0].success and tier.store.flush(30)
        bad = _chunk_file(tmp_path / "ssd", tier, ks[1])
        blob = bytearray(bad.read_bytes())
        if damage == "flip_payload_byte":
            blob[4096 + 100] ^= 0xFF
        elif damage == "other_keys_chunk":
            blob = bytearray(_chunk_file(tmp_path / "ssd", tier, ks[2]).read_bytes())
        else:
            blob = blob[:len(blob) // 2]
        bad.write_bytes(bytes(blob))
        arr[8:11] = 0
        tier.submit_load(rig.job(2, ks, [8, 9, 10], promotion=True))
        [res] = rig.finished(tier)
        assert not res.success
        assert set(res.successful_keys) == {ks[0], ks[2]}  # vLLM keeps these and recomputes ks[1]
        assert arr[8].tobytes() == data[0] and arr[10].tobytes() == data[2]
        assert tier.lookup(ks[1], REQ) is LookupResult.MISS   # not promoted again and again
        tier.submit_store(rig.job(3, [ks[1]], [1], promotion=False))   # stored again: found again
        assert rig.finished(tier)[0].success
        assert tier.lookup(ks[1], REQ) is LookupResult.HIT
    finally:
        tier.shutdown()


def test_a_job_whose_work_fails_is_a_failed_job(disk_tier):
    tier, arr = disk_tier
    ks = rig.keys(1, seed=7)
    tier.submit_store(rig.job(1, ks, [10_000], promotion=False))   # a slot outside the primary
    tier.submit_load(rig.job(2, rig.keys(1, seed=8), [0], promotion=True))   # a chunk nobody stored
    res = {r.job_id: r for r in rig.finished(tier, 2)}
    assert not res[1].success and not res[2].success
    assert not res[2].successful_keys


def test_eviction_under_a_small_budget_reported_as_removal_events(tmp_path):
    tier, arr = rig.build_tier(rig.disk_entry(tmp_path / "ssd", capacity="1MiB", enable_kv_events=True),
                               events=True)
    try:
        ks = rig.keys(40, seed=9)
        for i in range(0, 40, 8):
            rig.fill(arr, range(8), seed=10 + i)
            tier.submit_store(rig.job(i, ks[i:i + 8], list(range(8)), promotion=False))
            assert rig.finished(tier)[0].success
            assert tier.store.flush(30)
        usage = tier.store.disk.usage()
        assert usage.used_bytes <= usage.capacity_bytes == 2**20
        held = [k for k in ks if tier.lookup(k, REQ) is LookupResult.HIT]
        assert 0 < len(held) < 40
        events = list(tier.take_events())
        stored = {k for e in events if not e.removed for k in e.keys}
        removed = {k for e in events if e.removed for k in e.keys}
        assert stored == set(ks)
        assert removed and removed == set(ks) - set(held)
        assert all(e.medium is Medium.STORAGE for e in events)
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_no_events_when_vllm_kv_events_are_off(tmp_path):
    tier, arr = rig.build_tier(rig.disk_entry(tmp_path / "ssd", enable_kv_events=True), events=False)
    try:
        tier.submit_store(rig.job(1, rig.keys(2), [0, 1], promotion=False))
        assert rig.finished(tier)[0].success
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def _steps_until(manager, done, timeout: float = 30.0) -> bool:
    """Scheduler steps (``on_schedule_end``) until ``done()``; False if it never happened."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        manager.on_schedule_end(STEP)
        if done():
            return True
        time.sleep(0.002)
    return done()


def test_jobs_through_vllms_tiering_manager(tmp_path):
    """vLLM's TieringOffloadingSpec builds the manager, the primary region and this tier; a stored
    chunk cascades to the tier, the primary is reset, a lookup promotes it back, bytes identical."""
    cfg = rig.offloading_config(num_chunks=8, events=True,
                                secondary_tiers=[rig.disk_entry(tmp_path / "ssd", enable_kv_events=True)])
    manager = rig.spec(cfg).get_manager()
    [tier] = manager.secondary_tiers
    assert isinstance(tier, KvtierSecondaryTier)
    view = manager.primary_tier.get_kv_memoryview()
    prim = np.frombuffer(view, dtype=np.int8).reshape(view.shape)
    try:
        ks = rig.keys(4, seed=11)
        a = ReqContext(req_id="a")
        manager.on_new_request(a)
        out = manager.prepare_store(ks, a)
        rng = np.random.default_rng(12)
        data = {}
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):   # the worker's GPU -> CPU copy
            prim[c] = rng.integers(-128, 128, prim.shape[1], dtype=np.int8)
            data[k] = prim[c].tobytes()
        manager.complete_store(ks, a)                                   # cascades to kvtier's tier
        assert _steps_until(manager, lambda: not manager.has_pending_work())
        stored = [e for e in manager.take_events() if e.medium is Medium.STORAGE and not e.removed]
        assert {k for e in stored for k in e.keys} == set(ks)
        manager.on_request_finished(a)
        manager.reset_cache()                                           # the primary forgets everything
        prim[:] = 0
        b = ReqContext(req_id="b")
        manager.on_new_request(b)
        assert {manager.lookup(k, b) for k in ks} == {LookupResult.HIT_PENDING}   # promotions started
        assert _steps_until(manager, lambda: all(manager.lookup(k, b) is LookupResult.HIT for k in ks))
        load = manager.prepare_load(ks, b)
        assert [prim[c].tobytes() for c in load.chunk_ids] == [data[k] for k in ks]
        manager.complete_load(ks, b)
        manager.on_request_finished(b)
    finally:
        del prim
        view = None
        manager.shutdown()


def test_a_stalled_ssd_fails_the_load_within_its_deadline_and_the_key_is_a_miss_until_stored_again(tmp_path):
    """kvtier's drill (``store.faults``): after the two writes every SSD call stalls for 30 s. The
    load job fails at the load deadline (0.3 s), the chunk stays in the SSD index, and the tier
    answers MISS for it (not HIT: vLLM would promote it again and again) until it is stored again."""
    e = rig.entry(kvtier_config={"store": {"disk": {"enabled": True, "path": str(tmp_path / "ssd")},
                                           "faults": {"kind": "faulty", "wraps": "disk", "stall_after": 2,
                                                      "stall_s": 30.0}},
                                 "connector": {"load_timeout_s": 0.3}})
    tier, arr = rig.build_tier(e)
    try:
        ks = rig.keys(2, seed=13)
        rig.fill(arr, [0, 1], seed=14)
        tier.submit_store(rig.job(1, ks, [0, 1], promotion=False))
        assert rig.finished(tier)[0].success
        t0 = time.monotonic()
        tier.submit_load(rig.job(2, ks, [4, 5], promotion=True))
        [res] = rig.finished(tier, timeout=60)
        waited = time.monotonic() - t0
        assert not res.success and not res.successful_keys
        assert waited < 30.0, f"the load waited out the stall ({waited:.1f} s), not its deadline"
        assert all(tier.store.where(tier.keymap.chunk_key(k)) == "disk" for k in ks)   # still indexed
        assert [tier.lookup(k, REQ) for k in ks] == [LookupResult.MISS] * 2
    finally:
        tier.jobs.drain()
        tier.store.close()


def test_a_verified_chunk_of_another_size_under_the_key_is_a_failed_job(disk_tier):
    """A chunk that verifies (right namespace, key, checksum) but does not fill the slot exactly,
    e.g. written by a misconfigured peer, never loads as a slot with a stale tail."""
    tier, arr = disk_tier
    [k] = rig.keys(1, seed=15)
    assert tier.store.put(tier.keymap.chunk_key(k), None, b"\x01" * 4096, num_tokens=16, shape=(4096,),
                          dtype="uint8")
    assert tier.lookup(k, REQ) is LookupResult.HIT
    arr[3] = 9
    tier.submit_load(rig.job(1, [k], [3], promotion=True))
    [res] = rig.finished(tier)
    assert not res.success and not res.successful_keys
