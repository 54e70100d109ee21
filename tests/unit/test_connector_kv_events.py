"""KV events of kvtier's tiers: vLLM block hashes per chunk, medium per tier, the bounded map (no server).

Requests are vLLM's own ``Request`` objects hashed by vLLM's own block hasher, so the hashes the
events carry are checked against the prefix hashing an external indexer would run."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvtier.integrations.vllm.kv_events import KvEvents, chunk_blocks, ChunkHashMap, MEDIUM
from kvtier.transfer.page_layout import LBHNC
from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata, TierChange
from kvtier.integrations.vllm.reports import TierReports
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.keys import Namespace, chunk_keys
from kvtier.store_events import StoreEvent

BLOCK, CHUNK = 16, 64            # four vLLM blocks per kvtier chunk
BPC = CHUNK // BLOCK
NS = Namespace(model="m", model_fingerprint="f", dtype="float32", layout="lbhnc", block_size=BLOCK,
               chunk_size=CHUNK)


@pytest.fixture(scope="module")
def hash_fn():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return fn


def _request(req_id: str, tokens: list[int], hash_fn, **kw):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn), **kw)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def _raw_hashes(hash_fn, tokens: list[int]) -> list[bytes]:
    """What an external indexer computes for ``tokens``: vLLM's chained block hashes, by hand."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        out.append(hash_block_tokens(hash_fn, out[-1] if out else None, tokens[i * BLOCK:(i + 1) * BLOCK]))
    return out


def _indexer_hashes(hash_fn, tokens: list[int]) -> list:
    """Those hashes as vLLM's events carry them (64-bit ints by default, ``maybe_convert_block_hash``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in _raw_hashes(hash_fn, tokens)]


def _events(**kw) -> KvEvents:
    return KvEvents(enabled=True, chunk_size=CHUNK, block_size=BLOCK, **kw)


def test_stored_chunk_carries_its_blocks_hashes_parent_and_tokens(hash_fn):
    tokens = _prompt(3 * CHUNK + 5)
    req = _request("a", tokens, hash_fn)
    want = _indexer_hashes(hash_fn, tokens)
    ev = _events()
    keys = chunk_keys(NS, tokens)
    for ci in range(3):
        ev.remember(bytes(keys[ci]), req, ci)
    ev.on_changes([TierChange("stored", "memory", bytes(keys[0])), TierChange("stored", "disk", bytes(keys[2]))])
    first, third = ev.take()
    assert first.medium == "CPU" and first.locality == "LOCAL"
    assert first.block_hashes == want[0:BPC] and first.parent_block_hash is None
    assert first.token_ids == tokens[:CHUNK] and first.block_size == BLOCK
    assert third.medium == "DISK"
    assert third.block_hashes == want[2 * BPC:3 * BPC]
    assert third.parent_block_hash == want[2 * BPC - 1]        # the block before the chunk's first
    assert third.token_ids == tokens[2 * CHUNK:3 * CHUNK]
    assert ev.take() == []


def test_parent_hash_chains_to_the_chunks_first_block(hash_fn):
    """What an indexer does with a BlockStored: the parent is the hash of the block before the first
    one, and hashing each block's tokens (the event's own) onto the chain gives the event's hashes.
    A parent off by one block (or the chunk's own first hash) fails this."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    tokens = _prompt(4 * CHUNK, seed=3)
    req = _request("p", tokens, hash_fn)
    raw, conv = _raw_hashes(hash_fn, tokens), _indexer_hashes(hash_fn, tokens)
    ev = _events()
    keys = chunk_keys(NS, tokens)
    for ci in range(4):
        ev.remember(bytes(keys[ci]), req, ci)
    ev.on_changes([TierChange("stored", "memory", bytes(k)) for k in keys])
    events = ev.take()
    assert len(events) == 4
    for ci, e in enumerate(events):
        first = conv.index(e.block_hashes[0])
        assert first == ci * BPC
        assert e.parent_block_hash == (conv[first - 1] if first else None)
        parent = raw[first - 1] if first else None
        for i, h in enumerate(e.block_hashes):
            parent = hash_block_tokens(hash_fn, parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK])
            assert maybe_convert_block_hash(parent) == h


def test_eviction_removes_the_same_hashes_with_that_tiers_medium(hash_fn):
    tokens = _prompt(2 * CHUNK)
    req = _request("e", tokens, hash_fn)
    want = _indexer_hashes(hash_fn, tokens)
    ev = _events()
    k1 = bytes(chunk_keys(NS, tokens)[1])
    ev.remember(k1, req, 1)
    ev.on_changes([TierChange("stored", "memory", k1), TierChange("stored", "disk", k1),
                   TierChange("removed", "memory", k1)])
    s_mem, s_disk, r_mem = ev.take()
    assert r_mem.block_hashes == s_mem.block_hashes == want[BPC:2 * BPC]
    assert r_mem.medium == "CPU" and s_disk.medium == "DISK"
    assert ev.counts.stored == 2 and ev.counts.removed == 1


def test_shared_tier_chunks_are_announced_once_and_never_removed(hash_fn):
    tokens = _prompt(CHUNK)
    req = _request("s", tokens, hash_fn)
    ev = _events()
    k = bytes(chunk_keys(NS, tokens)[0])
    ev.remember(k, req, 0)
    ev.on_changes([TierChange("stored", "shared", k)])
    ev.on_changes([TierChange("stored", "shared", k), TierChange("removed", "shared", k)])
    (only,) = ev.take()
    assert only.medium == MEDIUM["shared"] == "SHARED" and only.locality == "REMOTE"


def test_the_map_is_bounded_and_a_forgotten_chunks_change_is_skipped_and_counted(hash_fn):
    tokens = _prompt(4 * CHUNK)
    req = _request("m", tokens, hash_fn)
    keys = [bytes(k) for k in chunk_keys(NS, tokens)]
    ev = _events(capacity=2)
    for ci in range(3):
        ev.remember(keys[ci], req, ci)
    assert len(ev.map) == 2 and ev.map.forgotten == 1 and keys[0] not in ev.map
    ev.on_changes([TierChange("removed", "memory", keys[0]), TierChange("removed", "memory", keys[2])])
    (removed,) = ev.take()
    assert removed.block_hashes == _indexer_hashes(hash_fn, tokens)[2 * BPC:3 * BPC]
    assert ev.counts.unmapped == 1


def test_lru_keeps_what_was_used_recently():
    m = ChunkHashMap(2)
    blocks = SimpleNamespace()
    m.put(b"a", blocks)
    m.put(b"b", blocks)
    assert m.get(b"a") is blocks                 # a is now the most recent
    m.put(b"c", blocks)
    assert b"a" in m and b"b" not in m and m.forgotten == 1


def test_unhashed_chunk_is_not_remembered(hash_fn):
    req = _request("u", _prompt(CHUNK - 1), hash_fn)   # not even one full chunk hashed
    ev = _events()
    ev.remember(b"k", req, 0)
    assert len(ev.map) == 0 and ev.counts.unhashed == 1
    assert chunk_blocks(req, 0, CHUNK, BLOCK) is None


def test_errors_never_fail_and_are_counted_once_logged(caplog):
    class Broken:
        @property
        def block_hashes(self):
            raise RuntimeError("boom")

    ev = _events()
    ev.remember(b"k", Broken(), 0)
    ev.remember(b"k2", Broken(), 0)
    ev.on_changes([object()])                     # not a TierChange
    assert ev.counts.errors == 3
    assert sum("KV events" in r.getMessage() for r in caplog.records) == 2   # once per call site


def test_disabled_keeps_nothing(hash_fn):
    req = _request("d", _prompt(CHUNK), hash_fn)
    ev = KvEvents(enabled=False, chunk_size=CHUNK, block_size=BLOCK)
    ev.remember(b"k", req, 0)
    ev.on_changes([TierChange("stored", "memory", b"k")])
    assert len(ev.map) == 0 and ev.take() == []


# -- through the connector's halves ------------------------------------------------------------
@dataclass
class _Found:
    num_chunks: int
    tiers: tuple


class _Store:
    """Just enough store for both halves: a dict, events to the subscribers, an optional shared tier."""

    def __init__(self):
        self.data: dict[bytes, bytes] = {}
        self.listeners = []
        self.remote = False

    def has_remote(self):
        return self.remote

    def subscribe(self, listener):
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def where(self, key):
        return "memory" if bytes(key) in self.data else None

    def lookup(self, keys):
        n = 0
        while n < len(keys) and bytes(keys[n]) in self.data:
            n += 1
        return _Found(n, ("memory",) * n)

    def put(self, key, parent, payload, *, num_tokens, shape, dtype):
        self.data[bytes(key)] = bytes(payload)
        for listener in self.listeners:
            listener(StoreEvent("stored", "memory", (key,)))
        return True

    def evict(self, key):
        self.data.pop(bytes(key))
        for listener in self.listeners:
            listener(StoreEvent("evicted", "memory", (key,)))

    def prepare_memory(self, n):
        return False

    def start_background_threads(self):
        pass


def _run_saved_request(hash_fn, store, tokens, shared=False):
    """One request saved: planned by the scheduler, copied and put by the worker, reported back.
    ``shared``: the worker's store also writes a shared tier (the scheduler's asks none here)."""
    ev = _events()
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, kv_events=ev)
    store.remote = shared
    table = list(range(len(tokens) // BLOCK + 1))
    s.bind(lambda req_id: (table,))
    req = _request("r", tokens, hash_fn)
    s.after_alloc(req, s.num_new_matched_tokens(req, 0))
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={"r": len(tokens)}))
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(40, 2, BLOCK, 16) for i in range(2)}
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5.0, kv_events=True)
    w.register(kv)
    assert w.disabled is None
    w.save(meta)
    s.on_worker_meta(w.take_worker_meta())
    return s, w, ev


def test_scheduler_and_worker_announce_saves_and_evictions(hash_fn):
    store = _Store()
    tokens = _prompt(2 * CHUNK + 10)
    s, w, ev = _run_saved_request(hash_fn, store, tokens)
    want = _indexer_hashes(hash_fn, tokens)
    stored = ev.take()
    assert [e.block_hashes for e in stored] == [want[:BPC], want[BPC:2 * BPC]]
    assert {e.medium for e in stored} == {"CPU"}
    store.evict(chunk_keys(NS, tokens)[1])
    s.on_worker_meta(w.take_worker_meta())
    (removed,) = ev.take()
    assert removed.block_hashes == want[BPC:2 * BPC] and removed.medium == "CPU"


def test_a_save_accepted_by_the_shared_tier_is_announced_as_shared(hash_fn):
    store = _Store()
    tokens = _prompt(CHUNK + 1)
    _, _, ev = _run_saved_request(hash_fn, store, tokens, shared=True)
    assert [e.medium for e in ev.take()] == ["CPU", "SHARED"]


def test_tier_reports_keep_every_change_in_order():
    where: dict[bytes, str] = {}
    r = TierReports(lambda k: where.get(bytes(k)), track_changes=True)
    r.on_event(StoreEvent("stored", "memory", (b"a",)))
    r.on_event(StoreEvent("stored", "disk", (b"a",)))
    r.on_event(StoreEvent("evicted", "memory", (b"a",)))
    r.shared_stored([b"a"])
    assert r.take_changes() == [TierChange("stored", "memory", b"a"), TierChange("stored", "disk", b"a"),
                                TierChange("removed", "memory", b"a"), TierChange("stored", "shared", b"a")]
    assert r.take_changes() == []
    quiet = TierReports(lambda k: None)
    quiet.on_event(StoreEvent("stored", "memory", (b"a",)))
    assert quiet.take_changes() == []


def test_tensor_parallel_fold_stores_where_every_rank_did_removes_where_any_did():
    a = KvtierWorkerMetadata(tier_changes=[TierChange("stored", "memory", b"x"), TierChange("stored", "memory", b"y"),
                                           TierChange("removed", "disk", b"z")])
    b = KvtierWorkerMetadata(tier_changes=[TierChange("stored", "memory", b"x"), TierChange("removed", "disk", b"w")])
    assert a.aggregate(b).tier_changes == [TierChange("stored", "memory", b"x"), TierChange("removed", "disk", b"z"),
                                           TierChange("removed", "disk", b"w")]
