"""Paged KV layouts: copy whole blocks between vLLM's per-layer caches and one chunk payload.

A ``KVLayout`` names one engine layout (it is part of the cache namespace, so payloads
written under one layout are never read under another) and knows, for a per-layer
cache tensor, which physical axis indexes blocks. A chunk payload is ONE contiguous
buffer holding, for every layer in registration order, that layer's blocks of the chunk
in the engine's physical order: ``[num_layers, <per-layer physical shape with the block
axis cut to blocks_per_chunk>]``. Copies are whole-block ``index_select`` /
``index_copy_`` on the physical (contiguous) view of each layer, so no per-token work.

Layouts (the logical shapes are what vLLM hands to ``register_kv_caches``):

- ``cpu_lbhnc``     CPU attention: ``[num_blocks, kv_heads, block_size, 2*head_size]``
- ``fa_nhd``        FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_size]``
- ``fa_hnd``        same logical shape, physical ``[2, num_blocks, kv_heads, block_size, head_size]``
- ``flashinfer_nhd`` FlashInfer: ``[num_blocks, 2, block_size, kv_heads, head_size]``
- ``flashinfer_hnd`` same logical shape, physical ``[num_blocks, 2, kv_heads, block_size, head_size]``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch


class LayoutError(ValueError):
    """The engine's KV tensors do not match the layout this connector was configured for."""


@dataclass(frozen=True)
class KVLayout:
    """One paged KV layout.

    ``physical_order`` permutes the logical per-layer shape into memory order (the
    permuted view is contiguous); ``block_axis`` is the block axis in that physical view;
    ``block_size_axis`` is where the tokens-per-block axis sits in the LOGICAL shape.
    """

    name: str
    ndim: int
    physical_order: tuple[int, ...]
    block_axis: int
    block_size_axis: int

    def physical(self, layer: "torch.Tensor") -> "torch.Tensor":
        """The contiguous physical view of one layer's cache (raises LayoutError otherwise)."""
        if layer.dim() != self.ndim:
            raise LayoutError(f"layout {self.name}: expected a {self.ndim}-d KV tensor, got shape "
                              f"{tuple(layer.shape)}")
        view = layer.permute(self.physical_order)
        if not view.is_contiguous():
            raise LayoutError(f"layout {self.name}: KV tensor of shape {tuple(layer.shape)} and strides "
                              f"{layer.stride()} is not contiguous in physical order {self.physical_order}")
        return view

    def block_size(self, layer: "torch.Tensor") -> int:
        return int(layer.shape[self.block_size_axis])

    def chunk_shape(self, layers: Sequence["torch.Tensor"], blocks_per_chunk: int) -> tuple[int, ...]:
        """Payload shape for one chunk: ``[num_layers, <physical shape, block axis = blocks_per_chunk>]``."""
        phys = list(self.physical(layers[0]).shape)
        phys[self.block_axis] = blocks_per_chunk
        return (len(layers), *phys)

    def gather(self, layers: Sequence["torch.Tensor"], block_ids: Sequence[int],
               out: "torch.Tensor") -> "torch.Tensor":
        """Copy ``block_ids`` of every layer into ``out`` (shape ``chunk_shape``); returns ``out``."""
        import torch

        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=layers[0].device)
        for i, layer in enumerate(layers):
            torch.index_select(self.physical(layer), self.block_axis, index, out=out[i])
        return out

    def scatter(self, layers: Sequence["torch.Tensor"], block_ids: Sequence[int],
                payload: "torch.Tensor", first_block: int = 0) -> None:
        """Copy blocks ``first_block:`` of a chunk ``payload`` into ``block_ids`` of every layer.

        ``len(block_ids)`` blocks are written; ``first_block`` skips leading blocks of the
        chunk that the engine already holds (its own prefix cache covers them).
        """
        import torch

        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=layers[0].device)
        n = len(block_ids)
        for i, layer in enumerate(layers):
            src = payload[i].narrow(self.block_axis, first_block, n)
            if src.device != layer.device:
                src = src.to(layer.device, non_blocking=True)
            self.physical(layer).index_copy_(self.block_axis, index, src)


CPU_LBHNC = KVLayout("cpu_lbhnc", ndim=4, physical_order=(0, 1, 2, 3), block_axis=0, block_size_axis=2)
FA_NHD = KVLayout("fa_nhd", ndim=5, physical_order=(0, 1, 2, 3, 4), block_axis=1, block_size_axis=2)
FA_HND = KVLayout("fa_hnd", ndim=5, physical_order=(0, 1, 3, 2, 4), block_axis=1, block_size_axis=2)
FLASHINFER_NHD = KVLayout("flashinfer_nhd", ndim=5, physical_order=(0, 1, 2, 3, 4), block_axis=0,
                          block_size_axis=2)
FLASHINFER_HND = KVLayout("flashinfer_hnd", ndim=5, physical_order=(0, 1, 3, 2, 4), block_axis=0,
                          block_size_axis=2)

LAYOUTS: dict[str, KVLayout] = {lay.name: lay for lay in
                                (CPU_LBHNC, FA_NHD, FA_HND, FLASHINFER_NHD, FLASHINFER_HND)}


def get_layout(name: str) -> KVLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"unknown KV layout {name!r}; known: {', '.join(sorted(LAYOUTS))}") from None


def layout_for_engine(platform: str, backend: str, kv_cache_layout: str | None) -> KVLayout:
    """The layout an engine uses, from its platform, attention backend name and vLLM's
    resolved ``kv_cache_layout`` (``LBNHC``/``NHD`` = token-major, ``LBHNC``/``HND`` = head-major).

    Derived the same way in the scheduler and the worker, so both halves agree on the namespace.
    """
    if platform == "cpu":
        return CPU_LBHNC
    hnd = (kv_cache_layout or "NHD").upper() in ("HND", "LBHNC", "BLHNC", "BHLNC", "LHBNC")
    b = backend.upper()
    if "FLASHINFER" in b:
        return FLASHINFER_HND if hnd else FLASHINFER_NHD
    if "FLASH_ATTN" in b or "FLASHATTN" in b or "TRITON" in b:
        return FA_HND if hnd else FA_NHD
    raise LayoutError(f"no kvtier layout for platform {platform!r} with attention backend {backend!r}")
