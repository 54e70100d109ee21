"""Derive how an engine's per-layer KV views are laid out, from their shapes and strides.

vLLM 0.32 registers one 4-d view per layer, logical ``[num_blocks, H, N, C]`` (block axis first),
made by ``create_kv_cache_views`` with strides from the resolved ``KVCacheLayout``. ``derive_views``
reads, from the views alone (never from a backend's name):

- the page: the ``H, N, C`` axes must form one dense run of elements (the layout is block-compact);
  their order in memory is the page order (``hnc`` for LBHNC/BLHNC, ``nhc`` for LBNHC/BLNHC);
- ``N`` must be the engine's block size (vLLM's kernel block splitting is refused);
- every layer the same shape, dtype and device (one KV-cache group of one kind);
- whether all layers are views of one allocation with one layer stride: then one strided view
  ``[L, B, page]`` covers every layer and a chunk moves in one gather or scatter call.

Pages are copied as raw words, whatever the KV dtype (an fp8 cache moves as any other): the widest
integer type (int64 down to uint8) that divides the page, the strides and the offsets. Wide words
matter on the CPU, where ``index_copy_`` moves one element at a time (a SmolLM2 chunk's scatter: 18.8 ms in
bytes, 2.9 ms in int64 words).

Axes of size 1 (one KV head, an MLA latent) may sit anywhere in memory: they decide nothing.

``head_views``: one ``KVViews`` per KV head over the same memory (views ``[:, h:h+1]``), for chunks stored
per KV head: a head's page is one dense run only where the head axis is the page's outermost (``hnc``).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Sequence

from kvtier.transfer.page_layout import LayoutError, PageLayout

if TYPE_CHECKING:
    import torch

_LETTERS = "hnc"


@dataclass
class KVViews:
    """vLLM's per-layer views and what kvtier derived from them."""

    layers: "list[torch.Tensor]"
    layout: PageLayout
    page_shape: tuple[int, ...]        # the page's axes in memory order
    pages: "list[torch.Tensor]"        # per layer: [num_blocks, page words] over the same memory
    stacked: "torch.Tensor | None"     # [L, num_blocks, page words] when one allocation holds every layer
    word: "torch.dtype"                # the integer type pages are copied in

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[0])

    @property
    def page_numel(self) -> int:
        return prod(self.page_shape)

    @property
    def dtype(self) -> "torch.dtype":
        return self.layers[0].dtype

    @property
    def device(self) -> "torch.device":
        return self.layers[0].device

    def chunk_shape(self, blocks_per_chunk: int) -> tuple[int, ...]:
        """A chunk payload: ``[num_layers, blocks_per_chunk, *page]``."""
        return (self.num_layers, blocks_per_chunk, *self.page_shape)

    def page_bytes(self) -> int:
        return self.page_numel * self.layers[0].element_size()

    def buffer_pages(self, buffer: "torch.Tensor") -> "torch.Tensor":
        """A (contiguous) chunk payload tensor as ``[num_layers, blocks_per_chunk, page words]``."""
        import torch

        return buffer.view(torch.uint8).view(self.word).view(self.num_layers, -1, self.page_words)

    @property
    def page_words(self) -> int:
        return self.page_bytes() // self.word.itemsize


def page_order(view: "torch.Tensor", expected: PageLayout | None = None) -> tuple[str, ...]:
    """The memory order of a view's ``H, N, C`` axes (largest stride first). An axis of size 1 takes
    its place in ``expected`` (or its logical place): its stride is meaningless."""
    dims = [1, 2, 3]
    real = sorted((d for d in dims if view.shape[d] != 1), key=lambda d: -view.stride(d))
    order = [_LETTERS[d - 1] for d in real]
    ref = list(expected.page_order) if expected is not None else list(_LETTERS)
    for d in dims:
        if view.shape[d] == 1:
            letter = _LETTERS[d - 1]
            before = ref[:ref.index(letter)]
            pos = sum(1 for x in order if x in before)
            order.insert(pos, letter)
    return tuple(order)


def _check_layer(view: "torch.Tensor", name: str, block_size: int, order: tuple[str, ...]) -> None:
    if int(view.shape[2]) != block_size:
        raise LayoutError(f"KV layer {name}: {view.shape[2]} tokens per kernel block, engine block size "
                          f"{block_size}: kvtier does not serve kernel block splitting; set --block-size "
                          f"{view.shape[2]}")
    if order[-1] != "c" and view.shape[3] != 1:
        raise LayoutError(f"KV layer {name}: the content axis is not innermost (strides {view.stride()})")
    stride = 1
    for letter in reversed(order):
        d = 1 + _LETTERS.index(letter)
        if view.shape[d] != 1 and view.stride(d) != stride:
            raise LayoutError(f"KV layer {name}: a block's pages are not one dense run (shape "
                              f"{tuple(view.shape)}, strides {view.stride()}); kvtier serves block-compact "
                              f"layouts (LBHNC, LBNHC, BLHNC, BLNHC)")
        stride *= int(view.shape[d])
    if view.shape[0] > 1 and view.stride(0) < stride:
        raise LayoutError(f"KV layer {name}: blocks overlap their pages (block stride {view.stride(0)} < page "
                          f"{stride} elements)")


def _word(layers: "list[torch.Tensor]", page: int) -> "torch.dtype":
    """The widest integer type that divides the page (bytes), every byte stride and offset, the storage."""
    import torch

    for word in (torch.int64, torch.int32, torch.int16):
        n = word.itemsize
        if page % n == 0 and all(t.storage_offset() % n == 0 and t.stride(0) % n == 0
                                 and t.untyped_storage().nbytes() % n == 0 for t in layers):
            return word
    return torch.uint8


def _words(byte_view: "torch.Tensor", word: "torch.dtype", size: tuple[int, ...], stride: tuple[int, ...],
           offset: int) -> "torch.Tensor":
    """A ``word`` tensor of ``size`` / ``stride`` / ``offset`` (in bytes) over ``byte_view``'s storage."""
    import torch

    n = word.itemsize
    st = byte_view.untyped_storage()
    flat = torch.empty(0, dtype=word, device=byte_view.device).set_(st, 0, (st.nbytes() // n,), (1,))
    return torch.as_strided(flat, size, tuple(x // n for x in stride), offset // n)


def _stacked(layers: "list[torch.Tensor]", page: int, word: "torch.dtype") -> "torch.Tensor | None":
    """``[L, B, page words]`` over every layer (byte views) when they are views of one allocation with one
    layer stride."""
    first = layers[0]
    base = first.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != base or t.stride(0) != first.stride(0) for t in layers):
        return None
    offsets = [t.storage_offset() for t in layers]
    step = offsets[1] - offsets[0] if len(layers) > 1 else page * first.shape[0]
    if step < page or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    blocks, bstride = int(first.shape[0]), first.stride(0)
    if not (step >= bstride * blocks or bstride >= step * len(layers)):   # layers interleaved otherwise
        return None
    if step % word.itemsize:
        return None
    return _words(first, word, (len(layers), blocks, page // word.itemsize), (step, bstride, word.itemsize),
                  first.storage_offset())


def derive_views(layers: "Sequence[torch.Tensor]", block_size: int, expected: PageLayout | None = None,
                 names: Sequence[str] | None = None) -> KVViews:
    """Check vLLM's per-layer views and derive their layout; LayoutError (one line) when kvtier cannot
    serve them, or when ``expected`` (the namespace's payload layout) is not what they are."""
    import torch

    layers = list(layers)
    names = list(names) if names is not None else [str(i) for i in range(len(layers))]
    if not layers:
        raise LayoutError("no KV cache layers were registered")
    first = layers[0]
    for t, name in zip(layers, names):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(f"KV layer {name} differs from {names[0]} in shape, dtype or device "
                              f"({tuple(t.shape)} {t.dtype} {t.device} vs {tuple(first.shape)} {first.dtype} "
                              f"{first.device}): kvtier serves one KV-cache group of one kind")
    if first.dim() != 4:        # every layer has the first's shape
        raise LayoutError(f"KV layer {names[0]}: expected vLLM's 4-d view [num_blocks, heads, block_size, content], "
                          f"got shape {tuple(first.shape)}")
    order = page_order(first, expected)
    layout = PageLayout(order)
    if expected is not None and layout != expected:
        raise LayoutError(f"the engine's KV views are laid out {layout.name}, the cache namespace expects "
                          f"{expected.name} (shape {tuple(first.shape)}, strides {first.stride()})")
    for t, name in zip(layers, names):
        _check_layer(t, name, block_size, order)
    page_shape = tuple(int(first.shape[1 + _LETTERS.index(x)]) for x in order)
    size = first.element_size()
    page = prod(page_shape) * size
    raw = [t.view(torch.uint8) for t in layers]       # the content axis is innermost: a byte view
    word = _word(raw, page)
    pages = [_words(t, word, (int(t.shape[0]), page // word.itemsize), (t.stride(0), word.itemsize),
                    t.storage_offset()) for t in raw]
    return KVViews(layers, layout, page_shape, pages, _stacked(raw, page, word), word)


def head_views(views: KVViews, block_size: int, names: Sequence[str] | None = None) -> list[KVViews]:
    """One ``KVViews`` per KV head of ``views`` (its pages: one head's ``[1, N, C]``), over the same memory;
    LayoutError (one line) when a head's page is not one dense run (the head axis is not the page's
    outermost, e.g. LBNHC)."""
    heads = int(views.layers[0].shape[1])
    if heads > 1 and views.layout.page_order[0] != "h":
        raise LayoutError(f"KV pages laid out {views.layout.name} do not keep a KV head's page in one run: "
                          f"chunks per KV head need the head axis outermost in the page (LBHNC or BLHNC)")
    return [derive_views([t[:, h:h + 1] for t in views.layers], block_size, expected=views.layout, names=names)
            for h in range(heads)]
