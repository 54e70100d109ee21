"""Scheduler- and worker-side connector logic with fake requests, a fake store and CPU tensors (no model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvtier.integrations.vllm.metadata import (
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadChunk,
    LoadOutcome,
    LoadPlan,
)
from kvtier.integrations.vllm.namespace import NamespaceError, check_chunk_size
from kvtier.integrations.vllm.scheduler_side import SchedulerSide, request_extra
from kvtier.integrations.vllm.worker_side import UnsupportedEngine, WorkerSide
from kvtier.keys import Namespace, chunk_keys
from kvtier.transfer.page_layout import LBHNC

BLOCK, CHUNK = 128, 256
NS = Namespace(model="m", model_fingerprint="f", dtype="float32", layout="lbhnc", block_size=BLOCK,
               chunk_size=CHUNK)


@dataclass
class FakeResult:
    num_chunks: int
    tiers: tuple


class FakeStore:
    """The store API the connector halves use, over a dict (no tiers, no threads)."""

    def __init__(self):
        self.data: dict[bytes, bytes] = {}
        self.lookups = 0
        self.puts: list[bytes] = []
        self.fail_gets: set[bytes] = set()
        self.listeners = []

    def has_remote(self):
        return False

    def shared_prefix(self, keys, deadline=None):
        raise AssertionError("no shared tier")

    def subscribe(self, listener):
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def where(self, key):
        return "memory" if key in self.data else None

    def get_into(self, key, out, *, promote=None, deadline=None, local_only=False):
        data = self.get(key)
        if data is None:
            return None
        out[:len(data)] = data
        return len(data)

    def busy(self):
        import contextlib
        return contextlib.nullcontext()

    def promote_later(self, keys, min_hits=1):
        return 0

    def prepare_memory(self, n):
        return False

    def start_background_threads(self):
        pass

    def lookup(self, keys):
        self.lookups += 1
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return FakeResult(n, ("memory",) * n)

    def get(self, key):
        if key in self.fail_gets:
            return None
        return self.data.get(key)

    def put(self, key, parent, payload, *, num_tokens, shape, dtype):
        assert parent is None or parent in self.data
        self.data[key] = bytes(payload)
        self.puts.append(key)
        from kvtier.store import StoreEvent
        for listener in self.listeners:
            listener(StoreEvent("stored", "memory", (key,)))
        return True


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: object = None
    mm_features: list = field(default_factory=list)

    @property
    def num_prompt_tokens(self):
        return len(self.prompt_token_ids)


class Tables:
    """Block tables the way the KV cache manager would hand them out."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}
        self.next = 0

    def alloc(self, req_id, num_tokens):
        t = self.tables.setdefault(req_id, [])
        while len(t) * BLOCK < num_tokens:
            t.append(self.next)
            self.next += 1
        return t

    def __call__(self, req_id):
        return self.tables[req_id]

    def per_group(self, req_id):
        """One block table per KV-cache group (one group), as ``KVCacheManager.get_block_ids``."""
        return (self.tables[req_id],)


def _sched(store, **kw):
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=kw.pop("min_hit_chunks", 1), **kw)
    tables = Tables()
    s.bind(tables.per_group)
    return s, tables


def _step(s, tables, req, num_new, external=0):
    """One scheduler step: (optional admission) allocate, build meta, advance computed tokens."""
    tables.alloc(req.request_id, req.num_computed_tokens + external + num_new)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: num_new}))
    req.num_computed_tokens += num_new
    return meta


def _admit(s, tables, req, local=0):
    ext = s.num_new_matched_tokens(req, local)
    s.after_alloc(req, ext)
    req.num_computed_tokens = local + ext
    return ext


def _prompt(n, seed=0):
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def _fill(store, tokens, n_chunks):
    for k in chunk_keys(NS, tokens)[:n_chunks]:
        store.data[k] = b"x"


def test_miss_saves_every_full_prompt_chunk():
    store = FakeStore()
    s, tables = _sched(store)
    req = FakeRequest("a", _prompt(600))
    assert _admit(s, tables, req) == 0
    meta = _step(s, tables, req, 600)
    assert meta.loads == []
    assert [c.chunk_index for c in meta.saves] == [0, 1]
    keys = chunk_keys(NS, req.prompt_token_ids)
    assert [c.key for c in meta.saves] == keys[:2]
    assert meta.saves[0].parent is None and meta.saves[1].parent == keys[0]
    assert meta.saves[1].block_ids == tuple(tables("a")[2:4])
    # decode steps save nothing more
    assert _step(s, tables, req, 1).saves == []


def test_full_hit_leaves_last_token_and_is_side_effect_free():
    store = FakeStore()
    tokens = _prompt(768)
    _fill(store, tokens, 3)
    s, tables = _sched(store)
    req = FakeRequest("a", tokens)
    first = s.num_new_matched_tokens(req, 0)
    assert first == s.num_new_matched_tokens(req, 0) == 640    # 767 usable tokens -> 5 whole blocks
    assert store.puts == [] and store.lookups == 2
    s.after_alloc(req, 640)
    req.num_computed_tokens = 640
    meta = _step(s, tables, req, 128)
    (plan,) = meta.loads
    assert (plan.start_token, plan.end_token) == (0, 640)
    t = tables("a")
    assert [(c.first_block, c.block_ids) for c in plan.chunks] == [(0, tuple(t[0:2])), (0, tuple(t[2:4])),
                                                                  (0, tuple(t[4:5]))]   # last chunk: 1 block
    assert meta.saves == []      # the store already holds all three chunks


def test_hit_beyond_block_aligned_local_prefix():
    store = FakeStore()
    tokens = _prompt(1000)
    _fill(store, tokens, 3)
    s, tables = _sched(store)
    req = FakeRequest("a", tokens)
    assert s.num_new_matched_tokens(req, 384) == 768 - 384
    assert s.num_new_matched_tokens(req, 768) == 0         # vLLM's prefix cache already has all kvtier has
    assert s.num_new_matched_tokens(req, 896) == 0
    assert _admit(s, tables, req, local=384) == 384
    tables.alloc("a", 384)
    meta = _step(s, tables, req, 232)
    (plan,) = meta.loads
    assert [(c.first_block, len(c.block_ids)) for c in plan.chunks] == [(1, 1), (0, 2)]
    assert plan.chunks[0].block_ids == (tables("a")[3],)


def test_min_hit_chunks_and_partial_prefix():
    store = FakeStore()
    tokens = _prompt(1100)
    _fill(store, tokens, 1)
    s, _ = _sched(store, min_hit_chunks=2)
    assert s.num_new_matched_tokens(FakeRequest("a", tokens), 0) == 0
    _fill(store, tokens, 2)
    assert s.num_new_matched_tokens(FakeRequest("b", tokens), 0) == 512
    other = tokens[:300] + _prompt(800, seed=5)      # shares only the first chunk
    s1, _ = _sched(store)
    assert s1.num_new_matched_tokens(FakeRequest("c", other), 0) == 256


def test_chunked_prefill_saves_only_completed_chunks():
    store = FakeStore()
    s, tables = _sched(store)
    req = FakeRequest("a", _prompt(1000))
    _admit(s, tables, req)
    assert [c.chunk_index for c in _step(s, tables, req, 300).saves] == [0]
    assert [c.chunk_index for c in _step(s, tables, req, 200).saves] == []
    assert [c.chunk_index for c in _step(s, tables, req, 300).saves] == [1, 2]
    assert [c.chunk_index for c in _step(s, tables, req, 200).saves] == []   # 1000 tokens: 3 full chunks


def test_preemption_restarts_without_resaving():
    store = FakeStore()
    s, tables = _sched(store)
    req = FakeRequest("a", _prompt(700))
    _admit(s, tables, req)
    meta = _step(s, tables, req, 700)
    for c in meta.saves:
        store.data[c.key] = b"x"
    # preempted: blocks freed, computed reset; vLLM asks again
    req.num_computed_tokens = 0
    tables.tables.pop("a")
    assert _admit(s, tables, req) == 512
    meta = _step(s, tables, req, 189)
    assert len(meta.loads) == 1 and meta.saves == []


def test_abort_drops_state():
    store = FakeStore()
    s, tables = _sched(store)
    req = FakeRequest("a", _prompt(600))
    _admit(s, tables, req)
    s.finished(req)
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={"a": 600})).saves == []


def test_extra_keys_separate_salts_and_loras():
    a = FakeRequest("a", _prompt(600))
    b = FakeRequest("b", _prompt(600), cache_salt="tenant-2")
    c = FakeRequest("c", _prompt(600), lora_request=SimpleNamespace(lora_name="x", lora_int_id=3, lora_path="/p"))
    extras = {request_extra(r) for r in (a, b, c)}
    assert len(extras) == 3 and request_extra(a) == b""
    store = FakeStore()
    _fill(store, a.prompt_token_ids, 2)
    s, _ = _sched(store)
    assert s.num_new_matched_tokens(a, 0) == 512
    assert s.num_new_matched_tokens(b, 0) == 0
    assert s.num_new_matched_tokens(c, 0) == 0


def test_worker_reported_keys_count_as_available():
    store = FakeStore()
    tokens = _prompt(600)
    s, _ = _sched(store, worker_key_capacity=100)
    keys = chunk_keys(NS, tokens)
    s.on_worker_meta(KvtierWorkerMetadata(pid=-1, loads={}, stored_keys=list(keys)))
    assert s.num_new_matched_tokens(FakeRequest("a", tokens), 0) == 512
    s.on_worker_meta(KvtierWorkerMetadata(pid=-1, loads={"a": LoadOutcome(0, 512, "miss")},
                                          missing_keys=[keys[1]]))
    assert s.num_new_matched_tokens(FakeRequest("b", tokens), 0) == 256


def test_chunk_size_must_be_a_multiple_of_block_size():
    check_chunk_size(256, 128)
    with pytest.raises(NamespaceError, match="multiple of the engine block size 128"):
        check_chunk_size(200, 128)


# ------------------------------------------------------------------ worker side

def _kv(num_blocks=16, layers=3, heads=2, head=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(layers, num_blocks, heads, BLOCK, 2 * head, generator=g)
    return {f"model.layers.{i}.self_attn.attn": base[i] for i in range(layers)}


def _worker(store, kv):
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5.0)
    w.register(kv)
    assert w.disabled is None
    return w


def test_worker_save_then_load_into_other_blocks_is_exact():
    store = FakeStore()
    tokens = _prompt(800)
    src_kv = _kv(seed=1)
    s, tables = _sched(store)
    req = FakeRequest("a", tokens)
    _admit(s, tables, req)
    meta = _step(s, tables, req, 800)
    w = _worker(store, src_kv)
    w.save(meta)
    w.end_step()
    assert len(store.puts) == 3
    wm = w.take_worker_meta()
    assert wm.stored_keys == store.puts

    dst_kv = {k: torch.zeros_like(v) for k, v in src_kv.items()}
    w2 = _worker(store, dst_kv)
    s2, tables2 = _sched(store)
    tables2.next = 5                               # different physical blocks this time
    req2 = FakeRequest("b", tokens)
    assert _admit(s2, tables2, req2) == 768
    meta2 = _step(s2, tables2, req2, 32)
    w2.load(meta2)
    assert w2.take_load_errors() == set()
    for name in src_kv:
        for i in range(6):
            assert torch.equal(dst_kv[name][tables2("b")[i]], src_kv[name][tables("a")[i]])
    assert w2.take_worker_meta().loads["b"].loaded_tokens == 768


def test_worker_failed_chunk_reports_blocks_and_skips_saves():
    store = FakeStore()
    tokens = _prompt(1100)
    src_kv = _kv(seed=2)
    s, tables = _sched(store)
    req = FakeRequest("a", tokens)
    _admit(s, tables, req)
    w = _worker(store, src_kv)
    w.save(_step(s, tables, req, 1100))
    keys = chunk_keys(NS, tokens)
    store.fail_gets.add(keys[1])                   # chunk 1 "corrupt" -> get returns None
    store.data.pop(keys[3])
    dst_kv = {k: torch.zeros_like(v) for k, v in src_kv.items()}
    w2 = _worker(store, dst_kv)
    s2, tables2 = _sched(store)
    req2 = FakeRequest("b", tokens)
    assert _admit(s2, tables2, req2) == 768
    meta = _step(s2, tables2, req2, 332)
    assert [c.chunk_index for c in meta.saves] == [3]
    n_puts = len(store.puts)
    w2.load(meta)
    errors = w2.take_load_errors()
    assert errors == set(tables2("b")[2:6])        # chunk 1 and everything after it
    w2.save(meta)
    assert len(store.puts) == n_puts               # nothing saved for a request whose load failed
    out = w2.take_worker_meta()
    assert out.loads["b"].loaded_tokens == 256 and out.loads["b"].failed_tokens == 512
    assert out.missing_keys == [keys[1]]
    w2.end_step()


def test_worker_refuses_an_engine_it_cannot_serve_at_start():
    store = FakeStore()
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5.0, engine="model m")
    with pytest.raises(UnsupportedEngine, match=r"\(model m\): KV layer l0: expected vLLM's 4-d view.*"
                                                 r"on_unsupported: serve-without-cache"):
        w.register({"l0": torch.zeros(2, 4, 16, 3, 8)})
    token_major = torch.zeros(4, BLOCK, 3, 16).transpose(1, 2)     # an LBNHC view: not the namespace's lbhnc
    with pytest.raises(UnsupportedEngine, match="laid out lbnhc, the cache namespace expects lbhnc"):
        w.register({"l0": token_major})


def test_worker_serving_without_cache_tells_the_scheduler_once():
    store = FakeStore()
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5.0,
                   on_unsupported="serve-without-cache")
    w.register({"l0": torch.zeros(4, 3, 2 * BLOCK, 16)})            # kernel block splitting
    assert w.disabled is not None and "block size" in w.disabled
    first = w.take_worker_meta()
    assert first is not None and "block size" in first.disabled
    assert w.take_worker_meta() is None
    plan = LoadPlan("r", 0, CHUNK, [LoadChunk(b"k" * 16, (0, 1))])
    w.load(KvtierConnectorMetadata(loads=[plan]))                  # a plan made before: recomputed, nothing copied
    assert w.take_load_errors() == {0, 1}


class SlowStore(FakeStore):
    """``slow_key``'s read blocks until ``release`` is set (at most 60 s)."""

    def __init__(self, slow_key):
        import threading

        super().__init__()
        self.slow_key = slow_key
        self.release = threading.Event()

    def get_into(self, key, out, **kw):
        if key == self.slow_key:
            self.release.wait(60)
        return super().get_into(key, out, **kw)


def _saved_store(store, tokens, kv):
    s, tables = _sched(store)
    req = FakeRequest("src", tokens)
    _admit(s, tables, req)
    w = _worker(store, kv)
    w.save(_step(s, tables, req, len(tokens)))
    w.end_step()
    return tables("src")


def test_worker_batch_of_loads_one_failing_others_exact():
    store = FakeStore()
    kv = _kv(seed=3)
    a, b = _prompt(1100, seed=1), _prompt(800, seed=2)
    ta = _saved_store(store, a, kv)
    tb = _saved_store(store, b, kv)
    store.fail_gets.add(chunk_keys(NS, a)[2])
    dst = {k: torch.zeros_like(v) for k, v in kv.items()}
    w = _worker(store, dst)
    s, tables = _sched(store)
    ra, rb = FakeRequest("a", a), FakeRequest("b", b)
    assert _admit(s, tables, ra) == 1024 and _admit(s, tables, rb) == 768
    tables.alloc("a", 1100)
    tables.alloc("b", 800)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={"a": 76, "b": 32}))
    w.load(meta)
    assert w.take_load_errors() == set(tables("a")[4:8])
    for name in kv:
        for i in range(4):
            assert torch.equal(dst[name][tables("a")[i]], kv[name][ta[i]])
        for i in range(6):
            assert torch.equal(dst[name][tables("b")[i]], kv[name][tb[i]])
    out = w.take_worker_meta().loads
    assert (out["a"].loaded_tokens, out["a"].failed_tokens) == (512, 512)
    assert (out["b"].loaded_tokens, out["b"].failed_tokens) == (768, 0)


def test_worker_load_deadline_turns_slow_reads_into_errors():
    tokens = _prompt(800)
    kv = _kv(seed=4)
    store = SlowStore(chunk_keys(NS, tokens)[1])
    _saved_store(store, tokens, kv)
    # 3 s: chunk 0's read (on a pool thread) must make it in time on a niced run beside busy cores
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=3.0)
    w.register({k: torch.zeros_like(v) for k, v in kv.items()})
    s, tables = _sched(store)
    req = FakeRequest("b", tokens)
    assert _admit(s, tables, req) == 768
    try:
        w.load(_step(s, tables, req, 32))
    finally:
        store.release.set()
    assert w.take_load_errors() == set(tables("b")[2:6])
    o = w.take_worker_meta().loads["b"]
    assert o.error == "timeout" and (o.loaded_tokens, o.failed_tokens) == (256, 512)


def test_full_hit_loads_part_of_the_last_chunk_exactly():
    store = FakeStore()
    tokens = _prompt(1536)                  # 6 full chunks; the last token lies in chunk 5
    kv = _kv(seed=5)
    src = _saved_store(store, tokens, kv)
    dst = {k: torch.zeros_like(v) for k, v in kv.items()}
    w = _worker(store, dst)
    s, tables = _sched(store)
    tables.next = 3
    req = FakeRequest("b", tokens)
    assert _admit(s, tables, req, local=256) == 1408 - 256    # up to the last whole block before the last token
    tables.alloc("b", 256)
    meta = _step(s, tables, req, 128)
    (plan,) = meta.loads
    assert [(c.first_block, len(c.block_ids)) for c in plan.chunks] == [(0, 2)] * 4 + [(0, 1)]
    w.load(meta)
    assert w.take_load_errors() == set()
    t = tables("b")
    for name in kv:
        for i in range(2, 11):
            assert torch.equal(dst[name][t[i]], kv[name][src[i]])
        assert not dst[name][t[11]].any()   # the block with the last token is computed by vLLM
    assert w.take_worker_meta().loads["b"].loaded_tokens == 1152


class _OldEngineRequest:
    """A request object from an engine version without ``cache_salt`` (an API change)."""

    def __init__(self, req_id, tokens):
        self.request_id, self.prompt_token_ids, self.num_computed_tokens = req_id, tokens, 0
        self.lora_request, self.mm_features = None, []

    @property
    def num_prompt_tokens(self):
        return len(self.prompt_token_ids)


def test_request_missing_a_key_field_is_not_cached_and_counted():
    from kvtier.integrations.vllm.metrics import ERRORS, ConnectorMetrics
    from kvtier.integrations.vllm.scheduler_side import KeyFieldsMissing

    old = _OldEngineRequest("old", _prompt(600))
    with pytest.raises(KeyFieldsMissing, match="cache_salt"):
        request_extra(old)
    store = FakeStore()
    _fill(store, old.prompt_token_ids, 2)      # the unsalted prefix IS stored: without the check it would hit
    s, tables = _sched(store, metrics=ConnectorMetrics())
    before = ERRORS.labels("key_fields_missing")._value.get()
    assert s.num_new_matched_tokens(old, 0) == 0
    assert s.num_new_matched_tokens(old, 0) == 0           # asked again: still refused, counted once
    assert ERRORS.labels("key_fields_missing")._value.get() == before + 1
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={"old": 600})).saves == []


def test_multimodal_input_without_identifier_is_refused():
    from kvtier.integrations.vllm.scheduler_side import KeyFieldsMissing

    r = FakeRequest("m", _prompt(600), mm_features=[SimpleNamespace(identifier="")])
    with pytest.raises(KeyFieldsMissing):
        request_extra(r)
    a = FakeRequest("a", _prompt(600), mm_features=[SimpleNamespace(identifier="img-1")])
    b = FakeRequest("b", _prompt(600), mm_features=[SimpleNamespace(identifier="img-2")])
    assert request_extra(a) != request_extra(b)
