"""Claims that pay off, through the connector's halves: the worker times its reads and forward
passes and reports them; the scheduler then leaves a slow tier's chunks to recompute (counted per
tier and reason), skips the shared tier's existence query when its first chunk would be declined,
and claims them all with ``claims.policy: always``."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch
from prometheus_client import REGISTRY

from kvtier.config import ClaimsConfig
from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.keys import chunk_keys
from kvtier.read_speed import TierSpeed
from tests.unit.fake_tiers import DictSharedTier
from tests.unit.test_connector_shared import _fill_shared, _store, _worker, wait_for
from tests.unit.test_connector_sides import BLOCK, CHUNK, NS, FakeRequest, FakeStore, Tables, _kv, _prompt

MB = 1 << 20
PAYS_OFF = ClaimsConfig(policy="pays-off")
ALWAYS = ClaimsConfig(policy="always")
#: an engine that computes 1,024 tokens in 20 ms: any read of ~10 ms per chunk is slower than that
FAST_ENGINE = KvtierWorkerMetadata(forward=(1024, 1024 ** 2, 0.02))


class SlowShared(DictSharedTier):
    """A shared tier whose every read takes ``delay_s`` (a far or overloaded backend)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.reads = 0

    def read_into(self, keys, outs, deadline, *, lent=False):
        self.reads += len(keys)
        time.sleep(self.delay_s)
        return super().read_into(keys, outs, deadline, lent=lent)


def declined(tier: str, reason: str) -> float:
    return REGISTRY.get_sample_value("kvtier_claims_declined_total", {"tier": tier, "reason": reason}) or 0.0


def _sched(store, claims, timeout: float = 30):
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, shared_lookup_timeout_s=timeout,
                      metrics=ConnectorMetrics(), claims=claims, worker_key_capacity=1000)
    tables = Tables()
    s.bind(tables.per_group)
    return s, tables


def _claim(s, req) -> int:
    assert wait_for(lambda: s.num_new_matched_tokens(req, 0) is not None)
    return s.num_new_matched_tokens(req, 0)


def _shared_load(s, tables, w, req, claim) -> KvtierWorkerMetadata:
    """Admit ``req`` with its claim, let the worker load it asynchronously, return the worker's report."""
    s.after_alloc(req, claim)
    tables.alloc(req.request_id, claim)
    w.load(s.build_meta(SimpleNamespace(num_scheduled_tokens={})))
    got: set[str] = set()
    assert wait_for(lambda: got.update(w.get_finished(set())) or req.request_id in got)
    return w.take_worker_meta()


def _two_prompts_in_slow_shared(tmp: Path):
    a, b = _prompt(1100, seed=1), _prompt(1100, seed=2)
    kv = _kv(seed=3)
    shared, _ = _fill_shared(tmp, a, kv)
    with _store(tmp / "a2", shared) as st:      # the second prompt too, through the same tier
        from tests.unit.test_connector_shared import _sched as plain_sched

        s, tables = plain_sched(st)
        req = FakeRequest("src2", b)
        assert wait_for(lambda: s.num_new_matched_tokens(req, 0) == 0)
        s.after_alloc(req, 0)
        tables.alloc("src2", len(b))
        w = _worker(st, kv)
        w.save(s.build_meta(SimpleNamespace(num_scheduled_tokens={"src2": len(b)})))
        assert st.flush(10)
        w.close()
    slow = SlowShared(0.05)
    slow.data = shared.data
    return a, b, kv, slow


def test_a_slow_shared_tier_is_measured_then_declined_and_counted(tmp_path: Path) -> None:
    a, b, kv, slow = _two_prompts_in_slow_shared(tmp_path)
    with _store(tmp_path / "b", slow) as st:
        s, tables = _sched(st, PAYS_OFF)
        w = _worker(st, {k: torch.zeros_like(v) for k, v in kv.items()})
        r1 = FakeRequest("r1", a)
        assert _claim(s, r1) == 1024 and s.load_async(r1)       # nothing measured yet: claimed
        wm = _shared_load(s, tables, w, r1, 1024)
        sp = wm.read_speeds["shared"]
        assert round(sp.weight) == 4 and sp.read_s() >= 0.05             # the worker timed its 4 reads
        s.on_worker_meta(wm)
        s.on_worker_meta(FAST_ENGINE)
        s.on_worker_meta(FAST_ENGINE)
        before, lookups = declined("shared", "slow"), slow.calls
        r2 = FakeRequest("r2", b)
        assert s.num_new_matched_tokens(r2, 0) == 0 and not s.load_async(r2)   # at once: no query asked
        assert slow.calls == lookups
        assert declined("shared", "slow") == before + 1
        assert s.num_new_matched_tokens(r2, 0) == 0
        assert declined("shared", "slow") == before + 1             # once per request
        w.close()
        s.close()


def test_without_the_policy_the_slow_tier_is_claimed(tmp_path: Path) -> None:
    a, b, kv, slow = _two_prompts_in_slow_shared(tmp_path)
    with _store(tmp_path / "b", slow) as st:
        s, tables = _sched(st, ALWAYS)
        w = _worker(st, {k: torch.zeros_like(v) for k, v in kv.items()})
        r1 = FakeRequest("r1", a)
        s.on_worker_meta(_shared_load(s, tables, w, r1, _claim(s, r1)))
        s.on_worker_meta(FAST_ENGINE)
        s.on_worker_meta(FAST_ENGINE)
        before = declined("shared", "slow")
        r2 = FakeRequest("r2", b)
        assert _claim(s, r2) == 1024 and s.load_async(r2)
        assert declined("shared", "slow") == before
        w.close()
        s.close()


def test_a_fast_tier_stays_claimed_under_the_policy(tmp_path: Path) -> None:
    a, b, kv, slow = _two_prompts_in_slow_shared(tmp_path)
    slow.delay_s = 0.0
    with _store(tmp_path / "b", slow) as st:
        s, tables = _sched(st, PAYS_OFF)
        w = _worker(st, {k: torch.zeros_like(v) for k, v in kv.items()})
        r1 = FakeRequest("r1", a)
        s.on_worker_meta(_shared_load(s, tables, w, r1, _claim(s, r1)))
        s.on_worker_meta(KvtierWorkerMetadata(forward=(1024, 1024 ** 2, 5.0)))   # a slow engine (this CPU)
        s.on_worker_meta(KvtierWorkerMetadata(forward=(1024, 1024 ** 2, 5.0)))
        assert _claim(s, FakeRequest("r2", b)) == 1024
        w.close()
        s.close()


def _local_chain(tiers: list[str], speeds: dict[str, TierSpeed]):
    tokens = _prompt(1100, seed=5)
    s, _ = _sched(FakeStore(), PAYS_OFF)
    keys = [bytes(k) for k in chunk_keys(NS, tokens)]
    s.on_worker_meta(KvtierWorkerMetadata(pid=0, stored_keys=keys[:len(tiers)], stored_tiers=tiers,
                                          read_speeds=speeds))
    s.on_worker_meta(FAST_ENGINE)
    s.on_worker_meta(FAST_ENGINE)
    return s, FakeRequest("r", tokens)


def test_the_chain_stops_at_the_first_slow_chunk_and_counts_the_rest():
    fast, slow = TierSpeed(0.0, 1e12, 10, MB), TierSpeed(0.0, 1e6, 10, MB)     # 1 s per 1 MiB chunk read
    s, req = _local_chain(["memory", "disk", "disk", "memory"], {"memory": fast, "disk": slow})
    labels = (("disk", "slow"), ("disk", "after_declined"), ("memory", "after_declined"))
    before = {lab: declined(*lab) for lab in labels}
    assert s.num_new_matched_tokens(req, 0) == CHUNK          # chunk 0 (RAM) only
    assert {lab: declined(*lab) - before[lab] for lab in labels} == dict.fromkeys(labels, 1.0)


def test_an_unavailable_tier_is_declined_and_a_vllm_cached_prefix_is_not_reloaded():
    fast = TierSpeed(0.0, 1e12, 10, MB)
    down = TierSpeed(0.0, 1e12, 10, MB, unavailable_s=30.0)
    s, req = _local_chain(["memory", "memory", "disk", "disk"], {"memory": fast, "disk": down})
    before = declined("disk", "unavailable")
    assert s.num_new_matched_tokens(req, 0) == 2 * CHUNK
    assert declined("disk", "unavailable") == before + 1
    assert s.num_new_matched_tokens(FakeRequest("r-cached", req.prompt_token_ids), 2 * CHUNK) == 0


def test_worker_times_forward_passes_and_local_reads(tmp_path: Path) -> None:
    tokens = _prompt(600, seed=9)
    kv = _kv(seed=4)
    with _store(tmp_path / "m", DictSharedTier()) as st:
        w = _worker(st, kv)
        w.step_bound(KvtierConnectorMetadata(step_tokens=600, step_span=600 ** 2))
        time.sleep(0.01)
        w.forward_done()
        w.forward_done()                                       # the first end counts
        keys = chunk_keys(NS, tokens)
        buf = w._copiers["load"].new_buffer()
        for i, k in enumerate(keys[:2]):
            assert st.put(k, keys[i - 1] if i else None, buf.bytes(), num_tokens=CHUNK,
                          shape=tuple(w.shape), dtype=w.dtype_name)
        assert w._read_chunk(bytes(keys[0]), buf) == (True, None)
        wm = w.take_worker_meta()
        tokens_, span, seconds = wm.forward
        assert (tokens_, span) == (600, 600 ** 2) and seconds >= 0.01
        assert round(wm.read_speeds["memory"].weight) == 1
        w.step_bound(KvtierConnectorMetadata(step_tokens=8))   # a decode step: too little to time
        w.forward_done()
        assert w.take_worker_meta() is None                     # nothing new to report
        w.close()


def test_the_shared_query_still_to_pay_counts_before_asking_only():
    from kvtier.integrations.vllm.claim_gate import ClaimGate

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    gate = ClaimGate(PAYS_OFF, chunk_size=CHUNK, clock=Clock())
    slept = gate.timed_query(lambda keys, deadline: time.sleep(0.05) or len(keys))
    assert slept([1, 2], None) == 2 and slept([1], None) == 1
    assert gate.query_s() >= 0.05
    gate.on_speeds({"shared": TierSpeed(0.0, MB / 0.01, 10, MB)})   # a fast read: 10 ms per chunk
    gate.on_forward(256, 256 ** 2, 0.04)                            # ~37 ms to compute a chunk
    gate.on_forward(256, 256 ** 2, 0.04)
    assert gate.prefill_cost() is not None
    assert gate.cut("r", ("shared",), 0, CHUNK)[0] == CHUNK                     # query paid: claimed
    end, d = gate.cut("r", ("shared",), 0, CHUNK, ask_shared=True)             # query + read > compute
    assert end == 0 and d.reason == "slow"
