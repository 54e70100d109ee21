"""Round trips of every paged KV layout: blocks -> one chunk payload -> other blocks."""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.vllm.layouts import (
    CPU_LBHNC,
    FA_HND,
    FA_NHD,
    FLASHINFER_HND,
    FLASHINFER_NHD,
    LayoutError,
    get_layout,
    layout_for_engine,
)

NUM_BLOCKS, BLOCK, HEADS, HEAD = 12, 16, 3, 8


def _layers(layout, n_layers=4, dtype=torch.float32):
    """Per-layer tensors shaped (and strided) as vLLM hands them to register_kv_caches,
    as views of ONE allocation like the engines do."""
    if layout is CPU_LBHNC:
        base = torch.randn(n_layers, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD).to(dtype)
        return [base[i] for i in range(n_layers)]
    if layout in (FA_NHD, FLASHINFER_NHD):
        shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD) if layout is FA_NHD else (NUM_BLOCKS, 2, BLOCK, HEADS, HEAD)
        base = torch.randn(n_layers, *shape).to(dtype)
        return [base[i] for i in range(n_layers)]
    # HND: logical shape is the NHD one; memory is [.., HEADS, BLOCK, HEAD]
    phys = (2, NUM_BLOCKS, HEADS, BLOCK, HEAD) if layout is FA_HND else (NUM_BLOCKS, 2, HEADS, BLOCK, HEAD)
    base = torch.randn(n_layers, *phys).to(dtype)
    return [base[i].permute(0, 1, 3, 2, 4) for i in range(n_layers)]


def _block(layout, layer, b):
    """Logical contents of block b of one layer (layout-independent view for comparisons)."""
    if layout is CPU_LBHNC:
        return layer[b]
    if layout in (FA_NHD, FA_HND):
        return layer[:, b]
    return layer[b]


@pytest.mark.parametrize("layout", [CPU_LBHNC, FA_NHD, FA_HND, FLASHINFER_NHD, FLASHINFER_HND],
                         ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(layout, dtype):
    src = _layers(layout, dtype=dtype)
    dst = [torch.zeros_like(t) for t in src]
    assert layout.block_size(src[0]) == BLOCK
    bpc = 3
    payload = torch.empty(layout.chunk_shape(src, bpc), dtype=dtype)
    layout.gather(src, [7, 2, 9], out=payload)
    assert payload.is_contiguous() and payload.shape[0] == len(src)
    layout.scatter(dst, [1, 4, 5], payload)
    for s, d in zip(src, dst):
        for sb, db in ((7, 1), (2, 4), (9, 5)):
            assert torch.equal(_block(layout, s, sb), _block(layout, d, db))
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 4, 5)]
        for b in untouched:
            assert not _block(layout, d, b).any()


@pytest.mark.parametrize("layout", [CPU_LBHNC, FA_NHD, FA_HND, FLASHINFER_NHD, FLASHINFER_HND],
                         ids=lambda l: l.name)
def test_partial_scatter_skips_leading_blocks(layout):
    src = _layers(layout)
    dst = [torch.zeros_like(t) for t in src]
    payload = torch.empty(layout.chunk_shape(src, 2), dtype=src[0].dtype)
    layout.gather(src, [3, 8], out=payload)
    layout.scatter(dst, [6], payload, first_block=1)   # engine already holds the chunk's first block
    for s, d in zip(src, dst):
        assert torch.equal(_block(layout, s, 8), _block(layout, d, 6))
        assert not _block(layout, d, 3).any()


def test_wrong_strides_are_refused():
    nhd = _layers(FA_NHD)
    with pytest.raises(LayoutError):
        FA_HND.physical(nhd[0])          # an NHD tensor is not contiguous in HND order
    with pytest.raises(LayoutError):
        CPU_LBHNC.physical(nhd[0])       # wrong rank


def test_engine_layout_selection():
    assert layout_for_engine("cpu", "CPU_ATTN", "LBHNC") is CPU_LBHNC
    assert layout_for_engine("cuda", "FLASH_ATTN", None) is FA_NHD
    assert layout_for_engine("cuda", "FLASH_ATTN", "HND") is FA_HND
    assert layout_for_engine("cuda", "FLASHINFER", "NHD") is FLASHINFER_NHD
    assert layout_for_engine("cuda", "FLASHINFER", "LBHNC") is FLASHINFER_HND
    assert get_layout("fa_hnd") is FA_HND
    with pytest.raises(LayoutError):
        layout_for_engine("cuda", "FLASHMLA", None)
    with pytest.raises(LayoutError):
        get_layout("nope")
