"""Chunks stored per KV head (``connector.tp_layout: per-kv-head``): a head's bytes are the same at every TP
size, so a TP = 1 engine loads what TP = 2 ranks saved and the reverse; each head is its own verified entry
and a chunk loads only when every head of it does; the ranks' reports of head keys are united."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import StoreConfig
from kvtier.integrations.vllm.cache_groups import chain, part_key
from kvtier.integrations.vllm.head_store import HeadSplitStore, SplitMeta
from kvtier.integrations.vllm.kv_heads import HeadShardingError, KvHeads, engine_kv_heads, head_chain, head_key
from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata
from kvtier.integrations.vllm.namespace import engine_namespace
from kvtier.integrations.vllm.step_plans import RequestState
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import TieredStore
from kvtier.tiers.protocol import Deadline, Status
from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.page_layout import LayoutError
from kvtier.transfer.views import derive_views, head_views

BLOCKS, BLOCK, HEAD, LAYERS, BPC = 10, 16, 8, 3, 2


def test_heads_shard_as_vllm_shards_them() -> None:
    assert [list(KvHeads.for_rank(4, 2, r).local) for r in range(2)] == [[0, 1], [2, 3]]
    assert list(KvHeads.for_rank(4, 1, 0).local) == [0, 1, 2, 3]
    assert [list(KvHeads.for_rank(2, 4, r).local) for r in range(4)] == [[0], [0], [1], [1]]   # replicated
    assert [list(KvHeads.for_rank(1, 2, r).local) for r in range(2)] == [[0], [0]]
    with pytest.raises(HeadShardingError, match="3 KV heads do not split evenly over 2"):
        KvHeads.for_rank(3, 2, 0)
    with pytest.raises(HeadShardingError, match="3 TP ranks"):
        KvHeads.for_rank(2, 3, 0)


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(0, 63), st.integers(1, 8))
def test_head_keys_never_alias_parts_or_chunks(key: bytes, head: int, parts: int) -> None:
    hk = head_key(key, head)
    assert len(hk) == 32 and hk != key and hk not in {part_key(key, p) for p in range(parts)}
    assert hk == head_key(key, head) and hk != head_key(key, head + 1)


def test_the_schedulers_chain_is_every_head_of_every_part() -> None:
    ns = Namespace("m", "f", "float32", "lbhnc/kvhead", 16, 32)
    keys = chunk_keys(ns, list(range(100)))
    state = RequestState(SimpleNamespace(), list(keys), b"")
    assert state.parts_chain(2, 4) == head_chain(chain(keys, 2), 4)
    assert len(state.parts_chain(2, 4)) == len(keys) * 8
    one = RequestState(SimpleNamespace(), list(keys), b"")
    assert one.parts_chain(1, 1) == head_chain(keys, 1)      # one head: still its own key


def _vllm_config(heads: int, tp: int) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", kv_cache_layout=None),
        model_config=SimpleNamespace(model="tiny", dtype="float32", get_total_num_kv_heads=lambda: heads),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def test_the_namespace_leaves_the_tp_size_out() -> None:
    one, two = _vllm_config(4, 1), _vllm_config(4, 2)
    a = engine_namespace(one, None, 64, per_kv_head=True)
    b = engine_namespace(two, None, 64, per_kv_head=True)
    assert a == b and a.layout == "lbhnc/kvhead" and (a.tp_rank, a.tp_size) == (0, 1)
    assert engine_namespace(two, None, 64).tp_size == 2 and engine_namespace(two, None, 64) != a
    assert engine_kv_heads(two, "per-kv-head", mla=False) == KvHeads(4, 0, 2)   # the scheduler process: rank 0
    assert engine_kv_heads(two, "per-rank", mla=False) is None
    assert engine_kv_heads(two, "per-kv-head", mla=True) is None
    with pytest.raises(HeadShardingError):
        engine_kv_heads(_vllm_config(3, 2), "per-kv-head", mla=False)
    with pytest.raises(HeadShardingError, match="Mamba state pages have no KV heads"):
        engine_kv_heads(one, "per-kv-head", mla=False, mamba=True)


def _cache(heads: int, seed: int, fill: bool = True) -> list[torch.Tensor]:
    """Per-layer CPU views [blocks, heads, block, 2 * head] (LBHNC) of one allocation."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(LAYERS, BLOCKS, heads, BLOCK, 2 * HEAD, generator=g) if fill else \
        torch.zeros(LAYERS, BLOCKS, heads, BLOCK, 2 * HEAD)
    return [raw[i] for i in range(LAYERS)]


def _copier(layers: list[torch.Tensor]) -> BlockCopier:
    views = derive_views(layers, BLOCK)
    return BlockCopier(views, BPC, slices=head_views(views, BLOCK))


def test_a_heads_bytes_are_the_same_at_every_tp_size_and_load_across_them() -> None:
    full = _cache(4, seed=1)                                        # TP = 1: every head
    ranks = [[t[:, 2 * r:2 * r + 2].clone() for t in full] for r in range(2)]   # TP = 2: each rank's heads
    one = _copier(full)
    assert all(v.stacked is not None for v in one.slices)          # one strided call per head
    buf = one.new_buffer()
    one.gather([3, 7], buf)
    assert buf.tensor.shape == (4, LAYERS, BPC, 1, BLOCK, 2 * HEAD) and buf.tensor.is_contiguous()
    heads = [buf.tensor[h].clone() for h in range(4)]
    for r, layers in enumerate(ranks):
        c = _copier(layers)
        b = c.new_buffer()
        c.gather([3, 7], b)
        assert all(torch.equal(b.tensor[s], heads[2 * r + s]) for s in range(2))
    # TP = 1's heads loaded into TP = 2's ranks (other blocks), and the reverse: the KV of those blocks moved
    for r in range(2):
        dst = [torch.zeros_like(t) for t in ranks[r]]
        c = _copier(dst)
        b = c.new_buffer()
        b.tensor.copy_(torch.stack(heads[2 * r:2 * r + 2]))
        c.scatter([0, 5], 0, b)
        for d, src in zip(dst, full):
            assert torch.equal(d[[0, 5]], src[[3, 7], 2 * r:2 * r + 2]) and not d[1].any()
    back = [torch.zeros_like(t) for t in full]
    c = _copier(back)
    b = c.new_buffer()
    b.tensor.copy_(torch.stack(heads))
    c.scatter([1], 1, b)                      # first block already held: only the second one moves
    for d, src in zip(back, full):
        assert torch.equal(d[1], src[7]) and not d[0].any()


def test_a_page_without_the_head_axis_outermost_is_refused() -> None:
    raw = torch.randn(LAYERS, BLOCKS, BLOCK, 4, 2 * HEAD)           # LBNHC: token-major pages
    views = derive_views([raw[i].permute(0, 2, 1, 3) for i in range(LAYERS)], BLOCK)
    with pytest.raises(LayoutError, match="head axis outermost"):
        head_views(views, BLOCK)


@pytest.fixture
def store(tmp_path: Path):
    cfg = StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False},
                                      "disk": {"enabled": True, "path": str(tmp_path), "capacity": 10**8}})
    s = TieredStore.open(cfg, Namespace("m", "f", "float32", "lbhnc/kvhead", 4, 4))
    yield s
    s.close()


def test_each_head_is_its_own_entry_and_a_chunk_needs_every_head(store) -> None:
    rank0, rank1, whole = (HeadSplitStore(store, KvHeads(4, 0, 2)), HeadSplitStore(store, KvHeads(4, 2, 2)),
                           HeadSplitStore(store, KvHeads(4, 0, 4)))
    ns = Namespace("m", "f", "float32", "lbhnc/kvhead", 4, 4)
    k1, k2 = chunk_keys(ns, list(range(8)))
    heads = [bytes([h]) * 64 for h in range(4)]
    for s, first in ((rank0, 0), (rank1, 2)):
        assert s.put(k1, None, b"".join(heads[first:first + 2]), num_tokens=4, shape=(2, 4, 16), dtype="uint8")
        assert s.put(k2, k1, b"".join(heads[first:first + 2]), num_tokens=4, shape=(2, 4, 16), dtype="uint8")
    assert store.where(head_key(k1, 3)) == "disk" and store.where(k1) is None
    out = bytearray(256)
    assert whole.get_into(k2, out) == 256 and bytes(out) == b"".join(heads)      # TP = 1 reads TP = 2's heads
    [res] = whole.read_into([k1], [bytearray(256)], Deadline.after(5))
    assert res.ok and isinstance(res.meta, SplitMeta) and res.meta.payload_len == 256 and len(res.meta.heads) == 4
    assert whole.where(k1) == "disk"
    store.delete(head_key(k2, 3))                                  # one head of chunk 2 gone
    assert whole.get_into(k2, bytearray(256)) is None and whole.where(k2) is None
    assert rank0.get_into(k2, bytearray(128)) == 128                # rank 0's heads are all there
    got = whole.read_into([k1, k2], [bytearray(256), bytearray(256)], Deadline.after(5))
    assert [r.status for r in got] == [Status.HIT, Status.MISS]
    with pytest.raises(ValueError, match="is not 4 KV heads"):
        whole.put(k1, None, bytes(256), num_tokens=4, shape=(2, 8, 16), dtype="uint8")


def test_ranks_reports_of_head_keys_are_united() -> None:
    a = KvtierWorkerMetadata(1, stored_keys=[b"h0", b"h1"], stored_tiers=["memory", "memory"], per_kv_head=True)
    b = KvtierWorkerMetadata(2, stored_keys=[b"h2", b"h3"], stored_tiers=["disk", "memory"], per_kv_head=True)
    m = a.aggregate(b)
    assert m.stored_keys == [b"h0", b"h1", b"h2", b"h3"] and m.stored_tiers == ["memory", "memory", "disk", "memory"]
    assert m.per_kv_head
    per_rank = KvtierWorkerMetadata(1, stored_keys=[b"c0", b"c1"]).aggregate(KvtierWorkerMetadata(2, stored_keys=[b"c1"]))
    assert per_rank.stored_keys == [b"c1"]                         # per rank: only where every rank stored it


def test_a_corrupt_head_fails_its_chunk_and_never_lands_as_kv(store) -> None:
    """One head's entry corrupted on the SSD: the chunk is a miss (vLLM recomputes it), the other chunk loads."""
    whole = HeadSplitStore(store, KvHeads(2, 0, 2))
    k1, k2 = chunk_keys(Namespace("m", "f", "float32", "lbhnc/kvhead", 4, 4), list(range(8)))
    assert whole.put(k1, None, bytes(range(128)), num_tokens=4, shape=(2, 64), dtype="uint8")
    assert whole.put(k2, k1, bytes(range(128, 256)), num_tokens=4, shape=(2, 64), dtype="uint8")
    assert store.flush(10)
    disk = store.tiers[0]
    path = Path(disk.path_of(head_key(k2, 1)))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF                                                  # the last payload byte of head 1
    path.write_bytes(bytes(raw))
    outs = [bytearray(128), bytearray(128)]
    got = whole.read_into([k1, k2], outs, Deadline.after(5))
    assert got[0].ok and bytes(outs[0]) == bytes(range(128))
    assert not got[1].ok and got[1].meta is None
    assert whole.get_into(k2, bytearray(128)) is None
