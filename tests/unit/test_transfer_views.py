"""kvtier's layout derivation against the views vLLM 0.32 itself makes (``create_kv_cache_views``) for
every ``KVCacheLayout``: exactly the block-compact layouts are served, and blocks round-trip
bit-exactly through a chunk payload (gather from one cache, scatter into another)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.page_layout import LayoutError, PageLayout, page_layout_of
from kvtier.transfer.views import derive_views

NUM_BLOCKS, BLOCK, HEADS, HEAD, LAYERS = 12, 16, 3, 8, 4
SERVED = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8-sized uint8": torch.uint8}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (random bytes include NaNs, which ``torch.equal`` calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def vllm_views(layout: KVCacheLayout, dtype: torch.dtype, spec=None, seed: int = 0) -> list[torch.Tensor]:
    """Per-layer views of one int8 allocation, made by vLLM's own code, filled with random bytes."""
    spec = spec or FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
    strides = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    size = LAYERS * NUM_BLOCKS * spec.page_size_bytes
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=g)
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda l: l.name)
def test_served_layouts_are_exactly_the_block_compact_ones(layout):
    views = vllm_views(layout, torch.bfloat16)
    if layout.name in SERVED:
        kv = derive_views(views, BLOCK)
        assert kv.layout == page_layout_of(layout.name)
        assert kv.layout.name == "lb" + layout.name[2:].lower()
        assert kv.stacked is not None            # one allocation, one layer stride: one call per chunk
        derive_views(views, BLOCK, expected=page_layout_of(layout.name))
    else:
        with pytest.raises(LayoutError, match="dense"):
            derive_views(views, BLOCK)
        with pytest.raises(LayoutError, match="LBHNC"):
            page_layout_of(layout.name)


@pytest.mark.parametrize("layout", sorted(SERVED))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_blocks_round_trip_bit_exact(layout, dtype):
    src = vllm_views(KVCacheLayout[layout], DTYPES[dtype], seed=1)
    dst = vllm_views(KVCacheLayout[layout], DTYPES[dtype], seed=2)
    before = [t.clone() for t in dst]
    a, b = derive_views(src, BLOCK), derive_views(dst, BLOCK)
    out_copier, in_copier = BlockCopier(a, 3), BlockCopier(b, 3)
    buf = out_copier.new_buffer()
    out_copier.gather([7, 2, 9], buf)
    assert buf.tensor.shape == (LAYERS, 3, *a.page_shape) and buf.tensor.is_contiguous()
    in_copier.scatter([1, 4, 5], 0, buf)
    for s, d, old in zip(src, dst, before):
        for sb, db in ((7, 1), (2, 4), (9, 5)):
            assert same(s[sb], d[db])
        for blk in set(range(NUM_BLOCKS)) - {1, 4, 5}:
            assert same(d[blk], old[blk])


@pytest.mark.parametrize("layout", sorted(SERVED))
def test_partial_and_per_layer_scatter(layout):
    src = vllm_views(KVCacheLayout[layout], torch.float32, seed=3)
    dst = vllm_views(KVCacheLayout[layout], torch.float32, seed=4)
    before = [t.clone() for t in dst]
    a, b = derive_views(src, BLOCK), derive_views(dst, BLOCK)
    buf = BlockCopier(a, 2).new_buffer()
    BlockCopier(a, 2).gather([3, 8], buf)
    copier = BlockCopier(b, 2)
    copier.scatter([6], 1, buf, layers=range(1, 2))      # the engine holds block 0 of the chunk; layer 1 only
    for i, (s, d, old) in enumerate(zip(src, dst, before)):
        assert same(d[6], s[8] if i == 1 else old[6])
        assert same(d[3], old[3])


def test_payload_is_the_page_bytes_in_memory_order():
    """The payload of an LBNHC engine is its pages as they lie in memory (token-major), not a transpose."""
    views = vllm_views(KVCacheLayout.LBNHC, torch.float32)
    kv = derive_views(views, BLOCK)
    assert kv.page_shape == (BLOCK, HEADS, 2 * HEAD)
    buf = BlockCopier(kv, 1).new_buffer()
    BlockCopier(kv, 1).gather([5], buf)
    assert same(buf.tensor[2, 0], views[2][5].permute(1, 0, 2))


def test_mla_latent_with_one_head_any_order():
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    for name in ("LBHNC", "LBNHC"):
        kv = derive_views(vllm_views(KVCacheLayout[name], torch.bfloat16, spec=spec), BLOCK,
                          expected=page_layout_of(name))
        assert kv.layout.name == "lb" + name[2:].lower() and kv.page_numel == BLOCK * 576


def test_refusals_name_the_problem():
    views = vllm_views(KVCacheLayout.LBHNC, torch.float32)
    with pytest.raises(LayoutError, match="block size"):
        derive_views(views, 32)                                        # kernel block splitting
    with pytest.raises(LayoutError, match="namespace expects lbnhc"):
        derive_views(views, BLOCK, expected=page_layout_of("LBNHC"))
    with pytest.raises(LayoutError, match="one KV-cache group"):
        derive_views([views[0], views[1][:, :2]], BLOCK)
    with pytest.raises(LayoutError, match="4-d"):
        derive_views([torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD)], BLOCK)
    with pytest.raises(LayoutError, match="4-d"):
        derive_views([torch.zeros(NUM_BLOCKS, BLOCK, HEAD)], BLOCK)        # was an IndexError, not a refusal
    with pytest.raises(LayoutError, match="no KV cache layers"):
        derive_views([], BLOCK)


def test_separate_tensors_are_copied_per_layer():
    layers = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    kv = derive_views(layers, BLOCK)
    assert kv.stacked is None and kv.layout.name == "lbhnc"
    buf = BlockCopier(kv, 2).new_buffer()
    BlockCopier(kv, 2).gather([0, 11], buf)
    assert all(torch.equal(buf.tensor[i, 1], layers[i][11]) for i in range(LAYERS))


def test_page_layout_names():
    assert PageLayout.parse("lbnhc") == page_layout_of("NHD") == page_layout_of("LBNHC")
    with pytest.raises(LayoutError):
        PageLayout.parse("cpu_lbhnc")
    with pytest.raises(LayoutError, match="unknown vLLM"):
        page_layout_of("XYZ")


def test_pages_move_in_the_widest_word_that_fits():
    """int64 words for vLLM's pages (index_copy_ is elementwise on the CPU); bytes where nothing wider divides."""
    assert derive_views(vllm_views(KVCacheLayout.LBHNC, torch.bfloat16), BLOCK).word == torch.int64
    odd = [t for t in torch.randint(0, 255, (2, 6, 1, 5, 3), dtype=torch.uint8)]     # 15-byte pages
    kv = derive_views(odd, 5)
    assert kv.word == torch.uint8
    dst = [torch.zeros_like(t) for t in odd]
    buf = BlockCopier(kv, 2).new_buffer()
    BlockCopier(kv, 2).gather([4, 1], buf)
    BlockCopier(derive_views(dst, 5), 2).scatter([0, 5], 0, buf)
    assert all(same(d[0], s[4]) and same(d[5], s[1]) for s, d in zip(odd, dst))
