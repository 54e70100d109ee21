"""The worker's copy lanes over vLLM's registered KV caches (``build_lanes``, at ``register_kv_caches``).

Layers are ordered by name (natural order, the same in every process); with several KV-cache groups the
first attention group's layers are the views of every group's pages (``check_overlay``; a Mamba group's
state tensors lie in the same pages). Their layout is derived from their
shapes and strides (``kvtier.transfer.views``) and must be the namespace's. With chunks stored per KV head
(``kv_heads``) each lane gets one view per KV head this rank holds and fills head-major buffers. One
``BlockCopier`` per kind of copy (saves, synchronous loads, layer-pipelined loads, background loads), and
the save lane's host buffers (``SAVE_BUFFERS``: one chunk's gather runs while the previous one is put).

Raises ``LayoutError`` or ``ValueError`` (one line) for an engine kvtier cannot serve; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.integrations.vllm.cache_groups import CacheGroups, check_overlay
from kvtier.integrations.vllm.chunk_saves import SaveTarget
from kvtier.integrations.vllm.kv_heads import KvHeads
from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.page_layout import PageLayout
from kvtier.transfer.streams import Streams, streams_for
from kvtier.transfer.views import KVViews, derive_views, head_views

if TYPE_CHECKING:
    import torch

SAVE_BUFFERS = 2
LANES = ("save", "load", "layers", "async")


def natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass
class Lanes:
    views: KVViews
    names: list[str]
    copiers: dict[str, BlockCopier]
    save: SaveTarget


def build_lanes(kv_caches: dict[str, "torch.Tensor"], *, groups: CacheGroups | None, layout: PageLayout,
                block_size: int, blocks_per_chunk: int, kv_heads: KvHeads | None,
                streams: Streams | None = None) -> Lanes:
    names = sorted(kv_caches, key=natural_key)
    if groups is not None and groups.hybrid:       # every group's pages are the view group's (check_overlay)
        names = sorted(groups.groups[groups.view_group].layers, key=natural_key)
    layers = [kv_caches[n] for n in names]
    check_overlay(groups, kv_caches, layers)
    views = derive_views(layers, block_size, expected=layout, names=names)
    heads = None
    if kv_heads is not None:
        got = int(views.layers[0].shape[1])
        if got != kv_heads.count:
            raise ValueError(f"the KV views hold {got} KV heads, the model's {kv_heads.total} over the TP ranks "
                             f"give this rank {kv_heads.count}")
        heads = head_views(views, block_size, names)
    streams = streams if streams is not None else streams_for(views.device)
    copiers = {lane: BlockCopier(views, blocks_per_chunk, streams, slices=heads) for lane in LANES}
    save = copiers["save"]
    buffers = [save.new_buffer() for _ in range(SAVE_BUFFERS)]
    target = SaveTarget(save, buffers, tuple(save.chunk_shape()), str(views.dtype).removeprefix("torch."),
                        buffers[0].nbytes)
    return Lanes(views, names, copiers, target)


__all__ = ["LANES", "Lanes", "SAVE_BUFFERS", "build_lanes", "natural_key"]
