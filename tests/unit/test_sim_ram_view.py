"""``ram_view: stored_keys`` (kvtier.sim.ram_view): the scheduler of kvtier's 2026-11-30 connector
saw the worker's RAM tier only as the last N keys the worker reported stored. It can then miss
a prefix RAM still holds and claim a chunk RAM already evicted, whose load fails."""

from __future__ import annotations

from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile
from kvtier.sim.ram_view import StoredKeysStore
from kvtier.sim.scheduler import EngineSim
from kvtier.sim.tiers import StoreModel
from kvtier.sim.trace import load_trace
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, write_workload

P = 8192


def _ram(chunks: int) -> StoreModel:
    return StoreModel.open({"ram": TierProfile(capacity=chunks * P, read_bw=1e9), "ssd": TierProfile(),
                            "shared": TierProfile()}, P, 4, "lru", 2)


def _history(m: StoreModel) -> None:
    for k in (1, 2, 3):
        m.save([k], 0)
    m.load([1], [0])                 # 1 read: newest in RAM's LRU, still the oldest report
    m.save([4], 0)                   # RAM evicts 2 (least recently used); the key list drops 1


def test_the_stored_keys_view_misses_what_ram_holds_and_claims_what_it_evicted() -> None:
    v = StoredKeysStore.over(_ram(3))
    _history(v)
    ram = v.tiers[0]
    assert 1 in ram and 2 not in ram
    assert v.lookup([1]) == []                       # RAM holds it; the scheduler does not know
    assert v.lookup([2]) == [0]                      # the scheduler believes RAM holds it
    t, served = v.load([2], [0])
    assert served == [] and t == 0.0 and v.failed_loads == 1
    assert v.lookup([2]) == []                       # reported missing: forgotten
    v.save([1], 0)                                   # a re-save of a present chunk is reported again
    assert v.lookup([1]) == [0] and v.tiers[0].evictions == 1


def test_the_exact_view_sees_the_ram_tier_as_it_is() -> None:
    e = _ram(3)
    _history(e)
    assert e.lookup([1]) == [0] and e.lookup([2]) == []


def test_a_failed_claim_counts_only_the_chunks_that_loaded(tmp_path) -> None:
    eng = EngineProfile(block_size=16, max_num_batched_tokens=256, max_num_seqs=4, kv_cache_tokens=16 * 40,
                        step_overhead_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3)
    prof = SimProfile(kv_bytes_per_token=1000, chunk_size=16, engine=eng, ram_view="stored_keys",
                      ram=TierProfile(capacity=10**8, read_bw=1e7))
    path = tmp_path / "w.jsonl"
    write_workload(path, WorkloadHeader(name="t"),
                   [Conversation(id="a", turns=[Turn(prompt_token_ids=list(range(100, 165)), max_tokens=2)])])
    tr = load_trace(path, unit_tokens=16)
    sim = EngineSim(tr, prof, LoadSpec(mode="closed", concurrency=1))
    keys = tr.hashes[tr.hoffsets[0]:tr.hoffsets[1]].tolist()          # 4 full blocks = 4 chunks
    store = sim.store
    assert isinstance(store, StoredKeysStore)
    store.save(keys[:2], 0)                          # RAM holds chunks 0, 1 (reported)
    store.view[keys[2]] = None                       # and the scheduler believes chunk 2 is there too
    r = sim.run()
    assert r.tier_tokens["ram"][0] == 2 * 16         # claimed 3 chunks, 2 loaded; chunk 2 recomputed
    assert store.failed_loads == 1
    assert r.load_s[0] == 2 * 16 * 1000 / 1e7
    # saves resume after the claim (chunk 2 is believed stored): chunk 3 is then an orphan, refused
    assert keys[2] not in store.tiers[0] and keys[3] not in store.tiers[0]
