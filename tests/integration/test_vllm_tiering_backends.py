"""kvtier's secondary tier for vLLM's offloading on REAL shared backends, no engine: vLLM's
``TieringOffloadingSpec`` / ``TieringOffloadingManager`` (CPU primary in a ``SharedOffloadRegion``)
or the tier built by ``SecondaryTierFactory``, with real ``OffloadKey``s and ``TransferJob``s.

* JuiceFS, two mounts (two machines): a chunk stored through one engine's manager is promoted,
  bytes identical, by another engine's manager on the other mount; a corrupt chunk file and a chunk
  file holding another key's chunk become failed load jobs (the other keys load), never wrong bytes.
* Valkey: a stalled (SIGSTOPped) server makes load jobs fail within the deadline while lookups keep
  answering; once it resumes the tier is used again.
* Mooncake: a round trip into a machine whose SSD tier then holds the chunk; reads made corrupt by
  kvtier's fault drill (``FaultyTier``) are failed jobs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from kvtier.services.juicefs import JuiceFs
from kvtier.tiers.protocol import Deadline
from tests.services.fixtures import juicefs, mooncake, valkey_server  # noqa: F401
from tests.unit import vllm_tiering_rig as rig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROW = 256 * 1024                     # one primary chunk (bytes): small, to keep the suite fast
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _shared_entry(shared: dict, disk: Path | None = None, faults: dict | None = None) -> dict:
    store: dict = {"shared": {"lookup_timeout_s": 2.0, "io_timeout_s": 5.0, "probe_interval_s": 0.2, **shared}}
    if disk is not None:
        store["disk"] = {"enabled": True, "path": str(disk), "capacity": "64MiB"}
    if faults is not None:
        store["faults"] = {"kind": "faulty", "wraps": "shared", **faults}
    return rig.entry(kvtier_config={"store": store}, enable_kv_events=True)


def _until(check, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.01)
    return check()


def _store_through(tier, arr: np.ndarray, ks: list[bytes], seed: int) -> list[bytes]:
    data = rig.fill(arr, range(len(ks)), seed)
    tier.submit_store(rig.job(1, ks, list(range(len(ks))), promotion=False))
    [res] = rig.finished(tier)
    assert res.success
    assert tier.store.flush(30)                      # the shared tier's background writes landed
    return data


class _Engine:
    """One engine's scheduler side: vLLM's TieringOffloadingManager with kvtier's tier below its primary."""

    def __init__(self, tier_entry: dict, num_chunks: int = 16) -> None:
        cfg = rig.offloading_config(ROW, num_chunks=num_chunks, secondary_tiers=[tier_entry], events=True)
        self.manager = rig.spec(cfg).get_manager()
        [self.tier] = self.manager.secondary_tiers
        view = self.manager.primary_tier.get_kv_memoryview()
        self.prim = np.frombuffer(view, dtype=np.int8).reshape(view.shape)
        self.results: list = []
        inner = self.tier.get_finished_jobs
        self.tier.get_finished_jobs = lambda: self._record(inner())

    def _record(self, results):
        results = list(results)
        self.results.extend(results)
        return results

    def steps_until(self, done, timeout: float = 30.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.manager.on_schedule_end(STEP)
            if done():
                return True
            time.sleep(0.005)
        return done()

    def store(self, ks: list[bytes], req: str, seed: int) -> dict[bytes, bytes]:
        ctx = ReqContext(req_id=req)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(ks, ctx)
        rng = np.random.default_rng(seed)
        data = {}
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):    # the worker's GPU -> CPU copy
            self.prim[c] = rng.integers(-128, 128, ROW, dtype=np.int8)
            data[k] = self.prim[c].tobytes()
        self.manager.complete_store(ks, ctx)
        self.manager.on_request_finished(ctx)
        assert self.steps_until(lambda: not self.manager.has_pending_work())
        return data

    def lookups(self, ks: list[bytes], ctx: ReqContext) -> list[LookupResult]:
        return [self.manager.lookup(k, ctx) for k in ks]

    def close(self) -> None:
        self.prim = None
        self.manager.shutdown()


def _mounts(fs: JuiceFs):
    a, b = fs.mount("a"), fs.mount("b")
    (a.path / "kv").mkdir()
    assert _until(lambda: (b.path / "kv").is_dir())
    return a, b


def test_juicefs_two_machines_share_chunks_and_damage_is_a_failed_job(juicefs: JuiceFs) -> None:
    a, b = _mounts(juicefs)
    ea = _Engine(_shared_entry({"kind": "sharedfs", "path": str(a.path / "kv")}))
    eb = _Engine(_shared_entry({"kind": "sharedfs", "path": str(b.path / "kv")}))
    try:
        ks = rig.keys(6, seed=1)
        data = ea.store(ks, "a0", seed=2)
        assert ea.tier.store.flush(30)
        names = {eb.tier.keymap.chunk_key(k).hex() for k in ks}       # b's mount caches entries ~1 s
        assert _until(lambda: names <= {p.name[:64] for p in (b.path / "kv").rglob("*.kvc")})
        ctx = ReqContext(req_id="b0")
        eb.manager.on_new_request(ctx)
        assert set(eb.lookups(ks, ctx)) == {LookupResult.RETRY}     # asked in the background, not waited on
        assert eb.steps_until(lambda: eb.lookups(ks, ctx) == [LookupResult.HIT] * 6)   # promoted
        spec = eb.manager.prepare_load(ks, ctx)
        assert [eb.prim[c].tobytes() for c in spec.chunk_ids] == [data[k] for k in ks]
        eb.manager.complete_load(ks, ctx)
        eb.manager.on_request_finished(ctx)

        files = {k: next((a.path / "kv").rglob(ea.tier.keymap.chunk_key(k).hex() + "*")) for k in ks[3:]}
        blob = bytearray(files[ks[3]].read_bytes())
        blob[4096 + 7] ^= 0x5A
        files[ks[3]].write_bytes(bytes(blob))                          # corrupt payload
        files[ks[4]].write_bytes(files[ks[5]].read_bytes())            # another key's (valid) chunk
        fresh = _Engine(_shared_entry({"kind": "sharedfs", "path": str(b.path / "kv")}))   # an empty primary
        try:
            c2 = ReqContext(req_id="b1")
            fresh.manager.on_new_request(c2)
            assert fresh.steps_until(lambda: LookupResult.RETRY not in set(fresh.lookups(ks[3:], c2)) and
                                     LookupResult.HIT_PENDING not in set(fresh.lookups(ks[3:], c2)))
            failed = [r for r in fresh.results if not r.success]
            assert len(failed) == 1 and set(failed[0].successful_keys) == {ks[5]}
            assert fresh.lookups(ks[3:], c2) == [LookupResult.MISS, LookupResult.MISS, LookupResult.HIT]
            spec = fresh.manager.prepare_load([ks[5]], c2)
            assert fresh.prim[spec.chunk_ids[0]].tobytes() == data[ks[5]]
            fresh.manager.complete_load([ks[5]], c2)
            fresh.manager.on_request_finished(c2)
        finally:
            fresh.close()
    finally:
        eb.close()
        ea.close()


def test_valkey_stalled_server_fails_jobs_within_the_deadline_lookups_keep_answering(valkey_server) -> None:
    shared = {"kind": "valkey", "url": valkey_server.url, "lookup_timeout_s": 0.3, "io_timeout_s": 1.0}
    a, arr_a = rig.build_tier(_shared_entry(shared), bytes_per_block=ROW, num_chunks=8)
    b, arr_b = rig.build_tier(_shared_entry(shared), bytes_per_block=ROW, num_chunks=8)
    try:
        ks = rig.keys(4, seed=3)
        data = _store_through(a, arr_a, ks, seed=4)
        ctx = ReqContext(req_id="r")
        assert all(rig.resolve(b, k, ctx) is LookupResult.HIT for k in ks)
        valkey_server.pause()
        try:
            t0 = time.monotonic()
            b.submit_load(rig.job(10, ks, [4, 5, 6, 7], promotion=True))
            other = rig.keys(3, seed=5)
            c2 = ReqContext(req_id="r2")
            answers = [b.lookup(k, c2) for k in other]                 # returns at once, no I/O
            assert set(answers) == {LookupResult.RETRY}
            [res] = rig.finished(b, timeout=30)
            waited = time.monotonic() - t0
            assert not res.success and not res.successful_keys
            assert waited < 10 * 1.0, f"a load job on a stalled backend took {waited:.1f} s"
            assert all(rig.resolve(b, k, c2) is LookupResult.MISS for k in other)   # answered: unavailable = miss
        finally:
            valkey_server.resume()
        assert b.lookup(ks[0], ReqContext(req_id="r3")) is LookupResult.MISS   # failed: a miss until stored again
        probe = [b.keymap.chunk_key(k) for k in ks]
        assert _until(lambda: b.store.shared_prefix(probe, Deadline.after(1)).answered)   # the breaker closed
        rig.fill(arr_b, [4, 5, 6, 7], seed=99)
        ks2 = rig.keys(4, seed=6)
        data2 = _store_through(b, arr_b, ks2, seed=7)                  # writes work again
        arr_a[:] = 0
        a.submit_load(rig.job(20, ks2 + ks, [0, 1, 2, 3, 4, 5, 6, 7], promotion=True))
        [res] = rig.finished(a)
        assert res.success
        assert [arr_a[i].tobytes() for i in range(8)] == data2 + data
    finally:
        a.shutdown()
        b.shutdown()


def test_mooncake_round_trip_into_a_machine_with_an_ssd_tier_and_corrupt_reads_fail(mooncake, tmp_path) -> None:
    shared = {"kind": "mooncake", "master": mooncake.master_addr, "metadata_server": mooncake.metadata_url}
    a, arr_a = rig.build_tier(_shared_entry(shared), bytes_per_block=ROW, num_chunks=8)
    b, arr_b = rig.build_tier(_shared_entry(shared, disk=tmp_path / "ssd-b"), bytes_per_block=ROW, num_chunks=8)
    c, arr_c = rig.build_tier(_shared_entry(shared, faults={"corrupt_rate": 1.0}), bytes_per_block=ROW,
                              num_chunks=8)
    try:
        ks = rig.keys(4, seed=10)
        data = _store_through(a, arr_a, ks, seed=11)
        ctx = ReqContext(req_id="r")
        assert all(rig.resolve(b, k, ctx) is LookupResult.HIT for k in ks)
        b.submit_load(rig.job(2, ks, [4, 5, 6, 7], promotion=True))
        [res] = rig.finished(b)
        assert res.success and [arr_b[4 + i].tobytes() for i in range(4)] == data
        assert all(b.store.where(b.keymap.chunk_key(k)) == "disk" for k in ks)   # kept on b's SSD
        assert all(rig.resolve(c, k, ctx) is LookupResult.HIT for k in ks)
        c.submit_load(rig.job(3, ks, [0, 1, 2, 3], promotion=True))
        [res] = rig.finished(c)
        assert not res.success and not res.successful_keys
        assert all(c.lookup(k, ctx) is LookupResult.MISS for k in ks)
    finally:
        for t in (a, b, c):
            t.shutdown()
