"""The cache namespace of one vLLM engine, derived identically in the scheduler and the worker.

Everything that makes KV incompatible goes in: the served model (path or name) and a
fingerprint of its weights, the KV dtype, the chunk payload's layout, the engine block size, the
chunk size and the TP/PP rank and size. Both connector halves call ``engine_namespace``
with the same ``VllmConfig``; the payload layout comes from vLLM's resolved ``kv_cache_layout``
(``kvtier.transfer.page_layout``; kvtier asks for LBHNC), and the worker checks it against the
strides of the views it registers (``kvtier.transfer.views``), never from a backend's name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.keys import Namespace
from kvtier.transfer.page_layout import REQUIRED_LAYOUT, PageLayout, page_layout_of

if TYPE_CHECKING:
    from kvtier.integrations.vllm.cache_groups import CacheGroups
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class NamespaceError(ValueError):
    """The engine configuration cannot be cached by kvtier (one-line reason)."""


def weights_fingerprint(model: str) -> str:
    """Fingerprint of a local model folder (config.json bytes + weight file names and sizes);
    for a hub name, the name itself (vLLM resolved revision is not visible here)."""
    path = Path(model)
    if not path.is_dir():
        return "name:" + model
    h = hashlib.blake2b(digest_size=16)
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
    return h.hexdigest()


def kv_dtype_name(vllm_config: "VllmConfig") -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def resolved_layout_name(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> str:
    """vLLM's resolved KV cache layout (the engine core resolves it before the connector is built);
    the one kvtier asks for when none was resolved yet."""
    return (getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
            or REQUIRED_LAYOUT)


def engine_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> PageLayout:
    """The chunk payload layout of this engine; LayoutError when kvtier cannot serve its KV layout."""
    return page_layout_of(resolved_layout_name(vllm_config, kv_cache_config))


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    if block_size <= 0 or chunk_size % block_size:
        raise NamespaceError(
            f"kvtier store.chunk_size={chunk_size} must be a multiple of the engine block size "
            f"{block_size}; set store.chunk_size to a multiple of {block_size} (e.g. {2 * block_size})")


def engine_namespace(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None",
                     chunk_size: int, layout: PageLayout | None = None, deployment: str = "",
                     groups: "CacheGroups | None" = None, per_kv_head: bool = False) -> Namespace:
    """The namespace for this engine and rank. Raises NamespaceError on a bad chunk size.

    The layout names the payload layout and, beyond one full-attention group, the KV-cache groups
    (``CacheGroups.signature``: kinds, windows, layers per group), e.g. ``lbhnc/mlax2``: chunks of a
    model served with and without vLLM's hybrid KV cache manager never alias. Chunks stored per KV head
    (``per_kv_head``, ``kv_heads.py``) add ``/kvhead`` and leave the TP rank and size out: every TP size
    of the engine shares them."""
    block_size = int(vllm_config.cache_config.block_size)
    check_chunk_size(chunk_size, block_size)
    layout = layout or engine_layout(vllm_config, kv_cache_config)
    signature = groups.signature() if groups is not None else ""
    model = str(vllm_config.model_config.model)
    par = vllm_config.parallel_config
    tp_size, pp_size = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    tp_rank, pp_rank = parallel_ranks(vllm_config)
    if groups is not None and groups.mla:
        tp_rank, tp_size = 0, 1     # every TP rank holds the same latent: one set of chunks for all ranks
    elif per_kv_head:
        tp_rank, tp_size = 0, 1     # a KV head's bytes do not depend on the TP size
        signature = signature + "/kvhead" if signature else "kvhead"
    return Namespace(model=model, model_fingerprint=weights_fingerprint(model), dtype=kv_dtype_name(vllm_config),
                     layout=layout.name + (f"/{signature}" if signature else ""), block_size=block_size,
                     chunk_size=chunk_size, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                     deployment=deployment)


def parallel_ranks(vllm_config: "VllmConfig") -> tuple[int, int]:
    """(TP rank, PP rank) of this process; (0, 0) in the scheduler process (it looks up as rank 0)."""
    par = vllm_config.parallel_config
    if int(par.tensor_parallel_size) == 1 and int(par.pipeline_parallel_size) == 1:
        return 0, 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, ImportError):  # scheduler process: no groups
        return 0, 0
