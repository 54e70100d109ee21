"""vLLM's KV-cache groups as kvtier serves them: specs -> groups, part keys and chains, what a sliding
window keeps, and the scheduler's claims, loads and saves of a hybrid (several-group) engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)

from kvtier.integrations.vllm.cache_groups import (NULL_BLOCK, CacheGroup, CacheGroups, UnsupportedGroups,
                                                   cache_groups, chain, chain_parent, part_key)
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.keys import chunk_keys
from tests.unit.test_connector_sides import BLOCK, CHUNK, NS, FakeRequest, FakeStore, _prompt

WINDOW = 300      # tokens: a hit at 768 keeps blocks from (768 - 300 + 1) // 128 = 3 on


def _full(block=BLOCK):
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _swa(window=WINDOW, block=BLOCK):
    return SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=8, dtype=torch.float32,
                             sliding_window=window)


def _config(*specs, layers=2):
    groups = [KVCacheGroupSpec([f"model.layers.{g * layers + i}.attn" for i in range(layers)], spec)
              for g, spec in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


def test_specs_become_groups_in_vllms_order():
    groups = cache_groups(_config(_swa(), _full()))
    assert [g.kind for g in groups.groups] == ["sliding_window", "full"]
    assert groups.hybrid and groups.count == 2 and not groups.mla
    assert groups.groups[0].window == WINDOW and groups.groups[1].layers == ("model.layers.2.attn",
                                                                           "model.layers.3.attn")
    assert groups.signature() == "sliding_window300x2,fullx2"
    assert cache_groups(_config(_full())).signature() == ""        # one full group: the namespace it always had
    mla = cache_groups(_config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)))
    assert mla.mla and mla.signature() == "mlax2" and not mla.hybrid
    assert cache_groups(None) is None and cache_groups(SimpleNamespace(kv_cache_groups=[])) is None


@pytest.mark.parametrize("specs, words", [
    ((MambaSpec(block_size=BLOCK, shapes=((2, 4),), dtypes=(torch.float32,)), _full()), "Mamba"),
    ((_swa(block=64), _full()), "different block sizes"),
])
def test_groups_kvtier_cannot_serve_are_refused_with_the_reason(specs, words):
    with pytest.raises(UnsupportedGroups, match=words):
        cache_groups(_config(*specs))


def test_groups_of_unequal_layer_counts_are_refused():
    cfg = _config(_swa(), _full())
    cfg.kv_cache_groups[1].layer_names.append("model.layers.9.attn")
    with pytest.raises(UnsupportedGroups, match="unequal layer counts"):
        cache_groups(cfg)


@settings(max_examples=200, deadline=None)
@given(end=st.integers(0, 20_000), window=st.integers(1, 4096), block=st.sampled_from([16, 32, 64, 128]))
def test_first_needed_block_is_where_vllm_stops_giving_the_null_block(end, window, block):
    """vLLM gives a sliding-window group the null block for ``get_num_skipped_tokens(end) // block`` leading
    blocks (``add_local_computed_blocks``); kvtier loads from exactly the next one."""
    vllm_skipped = SlidingWindowManager.get_num_skipped_tokens(
        SimpleNamespace(sliding_window=window, extra_retained_tokens=0), end)
    grp = CacheGroup("sliding_window", ("a",), block, window)
    assert grp.first_needed_block(end) == vllm_skipped // block
    assert CacheGroup("full", ("a",), block).first_needed_block(end) == 0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 6), parts=st.integers(1, 5))
def test_parts_form_one_chain_with_part_zero_the_chunk_key(n, parts):
    keys = chunk_keys(NS, _prompt(n * CHUNK))
    links = chain(keys, parts)
    assert len(links) == n * parts and len(set(links)) == n * parts       # no two parts alias
    assert links[::parts] == [bytes(k) for k in keys]                   # part 0 keeps the chunk's key
    for i, key in enumerate(links):
        ci, p = divmod(i, parts)
        assert part_key(keys[ci], p) == key
        assert chain_parent(keys, ci, p, parts) == (links[i - 1] if i else None)


# -- the scheduler of a two-group engine (sliding window + full attention) ------------------------------
GROUPS = CacheGroups((CacheGroup("sliding_window", ("l0",), BLOCK, WINDOW), CacheGroup("full", ("l1",), BLOCK)))


class GroupTables:
    """One block table per group over one pool; a sliding-window group's blocks before the window of
    ``end`` are vLLM's null block (as ``add_local_computed_blocks`` gives them)."""

    def __init__(self):
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        self.next = 1

    def alloc(self, req_id, num_tokens, null_before=0):
        t = self.tables.setdefault(req_id, ([], []))
        for g, table in enumerate(t):
            while len(table) * BLOCK < num_tokens:
                null = g == 0 and len(table) < null_before
                table.append(NULL_BLOCK if null else self.next)
                self.next += 0 if null else 1
        return t

    def __call__(self, req_id):
        return self.tables[req_id]


def _hybrid(store, **kw):
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, groups=GROUPS, **kw)
    tables = GroupTables()
    s.bind(tables)
    return s, tables


def _fill_parts(store, tokens, n_chunks, skip=()):
    for key in chain(chunk_keys(NS, tokens)[:n_chunks], 2):
        if key not in skip:
            store.data[key] = b"x"


def test_a_chunk_is_held_only_when_every_part_is():
    store, tokens = FakeStore(), _prompt(1000)
    keys = chunk_keys(NS, tokens)
    _fill_parts(store, tokens, 3, skip={part_key(keys[2], 1)})       # chunk 2 lacks its full-attention part
    s, _ = _hybrid(store)
    assert s.num_new_matched_tokens(FakeRequest("a", tokens), 0) == 2 * CHUNK
    store.data[part_key(keys[2], 1)] = b"x"
    assert s.num_new_matched_tokens(FakeRequest("b", tokens), 0) == 3 * CHUNK
    assert s.load_async(FakeRequest("b", tokens)) is True       # every claim of several groups is asynchronous


def test_load_plan_writes_only_the_window_of_a_sliding_group_and_never_the_null_block():
    store, tokens = FakeStore(), _prompt(1000)
    keys = chunk_keys(NS, tokens)
    _fill_parts(store, tokens, 3)
    s, tables = _hybrid(store)
    req = FakeRequest("a", tokens)
    assert s.num_new_matched_tokens(req, 0) == 768
    s.after_alloc(req, 768)
    first_kept = GROUPS.groups[0].first_needed_block(768)       # (768 - 300 + 1) // 128 = 3
    tables.alloc("a", 768, null_before=first_kept)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    (plan,) = meta.loads
    assert plan.async_load and plan.whole and (plan.start_token, plan.end_token) == (0, 768)
    swa, full = tables("a")
    got = [(c.key, c.first_block, c.block_ids) for c in plan.chunks]
    assert got == [(part_key(keys[0], 1), 0, tuple(full[0:2])),
                   (part_key(keys[1], 0), 1, tuple(swa[3:4])), (part_key(keys[1], 1), 0, tuple(full[2:4])),
                   (part_key(keys[2], 0), 0, tuple(swa[4:6])), (part_key(keys[2], 1), 0, tuple(full[4:6]))]
    assert all(NULL_BLOCK not in c.block_ids for c in plan.chunks)


def test_a_null_block_where_kv_must_load_makes_no_plan():
    store, tokens = FakeStore(), _prompt(1000)
    _fill_parts(store, tokens, 3)
    s, tables = _hybrid(store)
    req = FakeRequest("a", tokens)
    s.after_alloc(req, s.num_new_matched_tokens(req, 0))
    tables.alloc("a", 768, null_before=5)       # vLLM freed more than the window allows: load nothing
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={})).loads == []


def test_saves_every_part_in_chain_order_and_stop_at_a_freed_window():
    store, tokens = FakeStore(), _prompt(1100)
    keys = chunk_keys(NS, tokens)
    s, tables = _hybrid(store)
    req = FakeRequest("a", tokens)
    s.after_alloc(req, s.num_new_matched_tokens(req, 0))
    tables.alloc("a", 600)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={"a": 600}))
    req.num_computed_tokens = 600
    swa, full = tables("a")
    assert [(c.key, c.parent, c.block_ids) for c in meta.saves] == [
        (part_key(keys[0], 0), None, tuple(swa[0:2])), (part_key(keys[0], 1), part_key(keys[0], 0), tuple(full[0:2])),
        (part_key(keys[1], 0), part_key(keys[0], 1), tuple(swa[2:4])),
        (part_key(keys[1], 1), part_key(keys[1], 0), tuple(full[2:4]))]
    swa[4] = NULL_BLOCK              # vLLM freed chunk 2's first sliding-window block before it was saved
    tables.alloc("a", 1100)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={"a": 500}))
    assert meta.saves == []          # the chain would have a gap: no later chunk is saved either


def test_a_failed_load_of_several_groups_claims_nothing_more_for_the_request():
    from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata, LoadOutcome

    store, tokens = FakeStore(), _prompt(1000)
    _fill_parts(store, tokens, 3)
    s, tables = _hybrid(store)
    req = FakeRequest("a", tokens)
    s.after_alloc(req, s.num_new_matched_tokens(req, 0))
    tables.alloc("a", 768, null_before=3)
    s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    s.on_worker_meta(KvtierWorkerMetadata(0, {"a": LoadOutcome(0, 768, "miss")}))
    req.num_computed_tokens = 0                  # vLLM's failed_recving: the request recomputes from its start
    assert s.num_new_matched_tokens(req, 0) == 0


# -- the worker of a two-group engine: the groups overlay one allocation ---------------------------------
class ReadingStore(FakeStore):
    """``FakeStore`` with the batched read the asynchronous loader uses."""

    def read_into(self, keys, outs, deadline=None, *, promote=None, local_only=False, lent=False):
        from kvtier.tiers.protocol import Status

        results = []
        for key, out in zip(keys, outs):
            data = self.get(key)
            if data is None:
                results.append(SimpleNamespace(status=Status.MISS, meta=None))
                continue
            out[:len(data)] = data
            results.append(SimpleNamespace(status=Status.HIT, meta=SimpleNamespace(payload_len=len(data))))
        return results


def _overlaid_kv(num_blocks=48, layers=2, seed=0):
    """Two groups of ``layers`` layers whose views are the same tensors (vLLM's overlay), and their groups."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(layers, num_blocks, 2, BLOCK, 16, generator=g)
    names = [[f"model.layers.{grp * layers + i}.self_attn.attn" for i in range(layers)] for grp in range(2)]
    kv = {name: base[i] for grp in names for i, name in enumerate(grp)}
    groups = CacheGroups((CacheGroup("sliding_window", tuple(names[0]), BLOCK, WINDOW),
                          CacheGroup("full", tuple(names[1]), BLOCK)))
    return kv, groups


def _hybrid_worker(store, kv, groups, **kw):
    from kvtier.integrations.vllm.worker_side import WorkerSide
    from kvtier.transfer.page_layout import LBHNC

    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5.0, groups=groups, **kw)
    w.register(kv)
    return w


def _plan_and_saves(store, tokens):
    """Scheduler-made saves of a 768-token prompt, then a later engine's whole plan for its hit."""
    s, tables = _hybrid(store)
    req = FakeRequest("src", tokens)
    s.after_alloc(req, s.num_new_matched_tokens(req, 0))
    tables.alloc("src", 1000)
    saves = s.build_meta(SimpleNamespace(num_scheduled_tokens={"src": 1000}))
    s2, tables2 = _hybrid(store)
    tables2.next = 21                          # the reader's blocks differ from the writer's
    req2 = FakeRequest("r", tokens)
    return saves, tables("src"), s2, tables2, req2


def test_a_hybrid_worker_saves_each_groups_blocks_and_loads_them_into_other_blocks_exactly():
    from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata

    store, tokens = ReadingStore(), _prompt(1000)
    kv, groups = _overlaid_kv(seed=3)
    w = _hybrid_worker(store, kv, groups)
    saves, src_tables, s2, tables2, req2 = _plan_and_saves(store, tokens)
    w.save(saves)
    assert len(store.data) == 6                # 3 chunks x 2 parts
    claim = s2.num_new_matched_tokens(req2, 0)
    s2.after_alloc(req2, claim)
    tables2.alloc("r", claim, null_before=groups.groups[0].first_needed_block(claim))
    meta = s2.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    kv2, _ = _overlaid_kv(seed=4)
    w2 = _hybrid_worker(store, kv2, groups)
    w2.load(meta)
    assert w2._async.wait_idle(10)
    assert w2.get_finished(set()) == {"r"} and w2.take_failed_requests() == set() and w2.take_load_errors() == set()
    layer0 = next(iter(kv))
    swa_dst, full_dst = tables2("r")
    swa_src, full_src = src_tables
    for i in range(claim // BLOCK):
        assert torch.equal(kv2[layer0][full_dst[i]], kv[layer0][full_src[i]])
    for i in range(groups.groups[0].first_needed_block(claim), claim // BLOCK):
        assert torch.equal(kv2[layer0][swa_dst[i]], kv[layer0][swa_src[i]])
    assert not isinstance(meta, KvtierConnectorMetadata) or meta.loads[0].whole


def test_a_failed_part_fails_the_request_never_block_ids():
    store, tokens = ReadingStore(), _prompt(1000)
    kv, groups = _overlaid_kv(seed=3)
    w = _hybrid_worker(store, kv, groups)
    saves, _, s2, tables2, req2 = _plan_and_saves(store, tokens)
    w.save(saves)
    store.fail_gets.add(part_key(chunk_keys(NS, tokens)[2], 0))     # one sliding-window part cannot be read
    claim = s2.num_new_matched_tokens(req2, 0)
    s2.after_alloc(req2, claim)
    tables2.alloc("r", claim, null_before=groups.groups[0].first_needed_block(claim))
    w2 = _hybrid_worker(store, _overlaid_kv(seed=4)[0], groups)
    w2.load(s2.build_meta(SimpleNamespace(num_scheduled_tokens={})))
    assert w2._async.wait_idle(10)
    assert w2.get_finished(set()) == {"r"}
    assert w2.take_failed_requests() == {"r"} and w2.take_load_errors() == set()   # vLLM: failed_recving
    assert w2.take_worker_meta().loads["r"].failed_tokens == claim


def test_groups_that_do_not_overlay_are_refused_at_register():
    from kvtier.integrations.vllm.worker_side import UnsupportedEngine

    kv, groups = _overlaid_kv()
    other = _overlaid_kv(seed=1)[0]
    for name in groups.groups[1].layers:
        kv[name] = other[name].clone()             # group 1 in tensors of its own
    with pytest.raises(UnsupportedEngine, match="does not overlay group 0"):
        _hybrid_worker(FakeStore(), kv, groups)
    served = _hybrid_worker(FakeStore(), kv, groups, on_unsupported="serve-without-cache")
    assert "does not overlay" in served.disabled


def test_one_sliding_window_group_loads_only_its_window_and_whole():
    """A model whose every layer has a sliding window (one group, e.g. Mistral's): no parts, only the blocks
    vLLM keeps for the hit, and a load that fails whole (cut at a failed block, vLLM would recompute from a
    point whose window holds null blocks)."""
    store, tokens = FakeStore(), _prompt(1000)
    keys = chunk_keys(NS, tokens)
    for k in keys[:3]:
        store.data[k] = b"x"
    one = CacheGroups((CacheGroup("sliding_window", ("l0",), BLOCK, WINDOW),))
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, groups=one)
    tables = GroupTables()
    s.bind(lambda rid: tables(rid)[:1])
    req = FakeRequest("a", tokens)
    assert s.num_new_matched_tokens(req, 0) == 768 and s.load_async(req) is True
    s.after_alloc(req, 768)
    tables.alloc("a", 768, null_before=one.groups[0].first_needed_block(768))
    (plan,) = s.build_meta(SimpleNamespace(num_scheduled_tokens={"a": 232})).loads
    swa = tables("a")[0]
    assert plan.whole and plan.async_load
    assert [(c.key, c.first_block, c.block_ids) for c in plan.chunks] == [
        (keys[1], 1, tuple(swa[3:4])), (keys[2], 0, tuple(swa[4:6]))]


def _engine_config(tp=1):
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", kv_cache_layout="LBHNC"),
        model_config=SimpleNamespace(model="m", dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def test_the_namespace_names_the_groups_and_mla_has_one_for_every_tp_rank(monkeypatch):
    from kvtier.integrations.vllm import namespace

    plain = namespace.engine_namespace(_engine_config(), None, 256)
    assert plain.layout == "lbhnc"                                   # one full-attention group: as it always was
    hybrid = namespace.engine_namespace(_engine_config(), None, 256, groups=cache_groups(_config(_swa(block=16),
                                                                                                 _full(block=16))))
    assert hybrid.layout == "lbhnc/sliding_window300x2,fullx2" and hybrid.digest() != plain.digest()
    mla_groups = cache_groups(_config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                       dtype=torch.bfloat16)))
    monkeypatch.setattr(namespace, "parallel_ranks", lambda cfg: (1, 0))      # the second of two TP ranks
    rank1 = namespace.engine_namespace(_engine_config(tp=2), None, 256, groups=mla_groups)
    monkeypatch.setattr(namespace, "parallel_ranks", lambda cfg: (0, 0))
    rank0 = namespace.engine_namespace(_engine_config(tp=2), None, 256, groups=mla_groups)
    assert rank0 == rank1 and (rank0.tp_rank, rank0.tp_size) == (0, 1) and rank0.layout == "lbhnc/mlax2"
    full_rank1 = namespace.engine_namespace(_engine_config(tp=2), None, 256)
    assert (full_rank1.tp_rank, full_rank1.tp_size) == (0, 2)        # K/V heads split: a namespace per rank


def test_chunk_bytes_come_from_vllms_pages_one_latent_for_mla_every_part_for_hybrids():
    from kvtier.integrations.vllm.connector import _chunk_bytes

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert _chunk_bytes(None, 256, _config(mla)) == 2 * 576 * 2 * 256          # 2 layers x latent x bf16, no K/V pair
    assert _chunk_bytes(None, 256, _config(_swa(), _full())) == 2 * (2 * 2 * 8 * 4 * 2) * 256   # 2 parts x 2 layers


def test_a_worker_that_does_not_write_saves_nothing():
    """With MLA and TP > 1 every rank holds the same latent: only rank 0 writes, every rank loads."""
    from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, SaveChunk
    from kvtier.integrations.vllm.worker_side import WorkerSide
    from kvtier.transfer.page_layout import LBHNC

    store = FakeStore()
    kv = {f"model.layers.{i}.attn": torch.zeros(8, 1, BLOCK, 16) for i in range(2)}
    meta = KvtierConnectorMetadata()
    meta.saves.append(SaveChunk("r", 0, b"k" * 32, None, (1, 2)))
    for writes, puts in ((False, 0), (True, 1)):
        w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=1.0, saves=writes)
        w.register(kv)
        w.save(meta)
        assert len(store.puts) == puts, (writes, store.puts)


def test_mla_on_the_reference_cpu_kernel_is_refused_and_elsewhere_served():
    from kvtier.integrations.vllm.cache_groups import cpu_mla_refusal

    mla = cache_groups(_config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)))

    def cfg(device, chunked):
        return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                               scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked))

    assert "no prefill over a cached context" in cpu_mla_refusal(mla, cfg("cpu", False))
    assert cpu_mla_refusal(mla, cfg("cpu", True)) == ""           # AMX MLA kernels: chunked prefill stays on
    assert cpu_mla_refusal(mla, cfg("cuda", False)) == ""
    assert cpu_mla_refusal(cache_groups(_config(_full())), cfg("cpu", False)) == ""
