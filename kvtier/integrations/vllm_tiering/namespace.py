"""kvtier's namespace for chunks of vLLM's primary offloading tier, and the key of each chunk.

A vLLM ``OffloadKey`` is a block hash plus a KV-cache group index. Under kvtier it becomes::

    ChunkKey = BLAKE2b-256(namespace digest || OffloadKey, person="kvtier-vllm-tier")

The namespace holds what makes primary chunks incompatible: the model and its weights, the KV
dtype, the tokens per hash and per chunk, the parallel layout, and a ``layout`` that names vLLM's
primary chunk (``vllm-offload-v1``, vLLM's KV cache layout, canonical or direct bytes, replicated
or not, the groups and their layers, the chunk's bytes). kvtier's own connector names its layouts
``lbhnc`` / ``lbnhc`` and chains its keys from token ids without a personalisation, so a chunk of
one can never be taken for a chunk of the other: their namespace digests differ (and every chunk
header carries its namespace, verified on read), and their key functions are distinct BLAKE2b
instances. Pure: no I/O, no vLLM import (the offloading config is read by attribute).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from kvtier.keys import KEY_BYTES, ChunkKey, Namespace

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

LAYOUT_PREFIX = "vllm-offload-v1"
_PERSON = b"kvtier-vllm-tier"          # BLAKE2b personalisation (16 bytes): this tier's keys only


def chunk_tokens(config: "OffloadingConfig") -> int:
    """Tokens in one primary chunk: the largest group's tokens per block x blocks per chunk."""
    per_block = max((g.tokens_per_block for g in config.groups), default=config.cache.tokens_per_hash)
    return int(per_block) * int(config.cache.blocks_per_chunk)


def layout_name(config: "OffloadingConfig", chunk_bytes: int) -> str:
    """The primary chunk's layout as one string (compact JSON after ``vllm-offload-v1:``)."""
    groups = [[int(g.group_id), int(g.tokens_per_block),
               hashlib.blake2b("\0".join(g.layer_names).encode(), digest_size=8).hexdigest()]
              for g in config.groups]
    par = config.parallel
    fields = {"kv_cache_layout": config.kv_cache_layout or "", "canonical": bool(config.canonical_layout),
              "replicated": bool(config.replicated_layout), "groups": groups, "chunk_bytes": int(chunk_bytes),
              "worker_bytes_per_block": int(config.worker_kv_bytes_per_block),
              "pcp": int(par.pcp_size), "dcp": int(par.dcp_size)}
    return LAYOUT_PREFIX + ":" + json.dumps(fields, sort_keys=True, separators=(",", ":"))


def offload_namespace(config: "OffloadingConfig", chunk_bytes: int, deployment: str = "") -> Namespace:
    """The namespace of this engine's primary chunks of ``chunk_bytes`` bytes."""
    from kvtier.integrations.vllm.namespace import weights_fingerprint

    par = config.parallel
    return Namespace(model=config.model.name, model_fingerprint=weights_fingerprint(config.model.name),
                     dtype=str(config.model.dtype).removeprefix("torch."),
                     layout=layout_name(config, chunk_bytes), block_size=int(config.cache.tokens_per_hash),
                     chunk_size=chunk_tokens(config), tp_size=max(1, int(par.tp_size)),
                     pp_size=max(1, int(par.pp_size)), deployment=deployment)


def offload_chunk_key(namespace: Namespace, offload_key: bytes) -> ChunkKey:
    """The kvtier key of one vLLM ``OffloadKey`` in ``namespace``."""
    h = hashlib.blake2b(namespace.digest(), digest_size=KEY_BYTES, person=_PERSON)
    h.update(offload_key)
    return ChunkKey(h.digest())
