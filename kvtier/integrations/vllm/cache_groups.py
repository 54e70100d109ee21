"""vLLM's KV-cache groups as kvtier serves them: one *part* per group in every chunk.

vLLM's hybrid KV cache manager (HMA) gives a model whose layers differ in what they keep several
KV-cache groups, each with its own block table over one shared block pool. Gemma 3 has sliding-window
groups (the last ``window`` tokens of every layer in them) beside a full-attention group; an MLA model
(DeepSeek) has one group whose page is a latent per token. The groups' layers *overlay* the same
allocation: layer ``i`` of every group is a view of the same bytes, and a block id belongs to one group
at a time (``vllm/v1/kv_cache_interface.py``, ``KVCacheTensor``).

kvtier stores a chunk of ``chunk_size`` tokens of a G-group model as G entries, one per group (its
*part*): the pages of the group's blocks for those tokens, over the group's layers. Part ``g`` of chunk
``i`` has the key ``part_key(chunk_key[i], g)`` (part 0 keeps the chunk's own key, so a one-group
engine stores exactly what it always did), and the parts form one chain in the store, chunk by chunk
and part by part (``chain``): a prefix lookup over that chain finds the chunks whose every part is
held, and the store's prefix-aware eviction removes chain tails first, so a chunk never loses a part
before a later chunk loses its own.

What a hit at token ``end`` loads of each group (``load_start``): a full-attention or MLA group, every
block from the engine's own hit on; a sliding-window group, only the blocks vLLM keeps for computing
token ``end`` (its last ``window - 1`` tokens): vLLM gives the blocks before them the null block
(id 0), and kvtier never writes into it. A save of a part whose blocks vLLM has already freed (a
sliding-window block outside the window, replaced by the null block) is never made
(``saveable``); the request saves no later chunk either (its chain would have a gap).

Mamba / linear-attention state (Qwen3-Next's Gated DeltaNet, Jamba, Granite 4) in vLLM's "align" prefix-cache
mode: block ``p`` of a request's Mamba table holds the state after exactly ``(p + 1) * block_size`` tokens, and
vLLM makes the attention page size equal to the state's (padded), so a state is one page of the shared
allocation. A chunk is then one block (``chunk_size`` = the engine's block size: a state exists only at block
ends), its Mamba part the state at the chunk's end, taken from the exact block vLLM offers for that boundary
(``KVConnectorBlockState.boundary_state_offloads``: the table is not append-only). vLLM keeps a state only at
some boundaries (a prompt's last block boundary, and each one decode crosses), so Mamba parts are *leaves*:
stored where vLLM offered the state, their parent the chunk's last chained part (``chain_parts``), never in the
chain that prefix lookups walk. A hit ends at the last chunk of the chain whose every Mamba part is held, and
loads of a Mamba group only the block of the state at its end (``first_needed_block``); vLLM gives the blocks
before it the null block, as for a sliding window (``sparse``).

Groups kvtier refuses (``cache_groups`` raises ``UnsupportedGroups`` with the reason): Mamba state without
"align" mode (vLLM keeps one running state per request: nothing to store per chunk) or with speculative blocks,
a model with no attention group, chunked-local attention, cross/encoder attention, circular buffers, and groups
whose block sizes differ.

No I/O; imports vLLM's spec classes only inside ``cache_groups``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0          # vLLM's null block (``BlockPool.null_block``): never read into a chunk, never written
_PART_PERSON = b"kvtier-part"    # BLAKE2b personalisation of part keys

GroupKind = Literal["full", "sliding_window", "mla", "mamba"]


class UnsupportedGroups(ValueError):
    """vLLM's KV-cache groups of this engine include one kvtier cannot serve (one-line reason)."""


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV-cache groups: what it keeps per token and for how long."""

    kind: GroupKind
    layers: tuple[str, ...]
    block_size: int
    window: int = 0            # sliding_window: tokens attended (0 = every token)

    def tag(self) -> str:
        """The group's part of the namespace: kind, window and layer count."""
        w = f"{self.window}" if self.kind == "sliding_window" else ""
        return f"{self.kind}{w}x{len(self.layers)}"

    def first_needed_block(self, end: int) -> int:
        """The first block vLLM keeps (non-null) for computing token ``end`` onwards (tokens
        ``[0, end)`` computed): for a sliding window, the blocks before ``end - window + 1`` are
        vLLM's null block (``get_num_skipped_tokens``); every block otherwise."""
        if self.kind == "mamba":          # the state after token ``end``: one block, ``end`` at its end
            return max(0, end // self.block_size - 1)
        if self.kind != "sliding_window":
            return 0
        return max(0, end - self.window + 1) // self.block_size


@dataclass(frozen=True)
class CacheGroups:
    """An engine's KV-cache groups in vLLM's order (part ``g`` = group ``g``)."""

    groups: tuple[CacheGroup, ...]

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        """More than one group: chunks have several parts (and loads report failures per request)."""
        return len(self.groups) > 1

    @property
    def sparse(self) -> bool:
        """A group vLLM gives the null block below what it keeps (a sliding window, Mamba state): never read or
        written there."""
        return any(g.kind in ("sliding_window", "mamba") for g in self.groups)

    @property
    def mamba(self) -> bool:
        return any(g.kind == "mamba" for g in self.groups)

    @property
    def chain_parts(self) -> tuple[int, ...]:
        """The parts every chunk has, in chain order: every group but Mamba state."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind != "mamba")

    @property
    def state_parts(self) -> tuple[int, ...]:
        """The Mamba groups' parts: a chunk has them only where vLLM kept the state at its end (leaves off the
        chain, ``chain_parts``' last part of the chunk their parent)."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind == "mamba")

    @property
    def view_group(self) -> int:
        """The group whose registered layers are the page views (the first attention group: a Mamba layer
        registers its state tensors, which overlay the same pages)."""
        return next(i for i, g in enumerate(self.groups) if g.kind != "mamba")

    @property
    def loads_whole(self) -> bool:
        """Loads must succeed or fail whole, reported per request: with several groups vLLM cannot map
        failed block ids back to requests, and with a sliding window a load cut at a failed block would
        leave vLLM recomputing from a point whose window holds null blocks."""
        return self.hybrid or self.sparse

    @property
    def mla(self) -> bool:
        return any(g.kind == "mla" for g in self.groups)

    def signature(self) -> str:
        """For the namespace: empty for one full-attention group (the namespace every one-group engine
        always had), else every group's tag in order, e.g. ``sliding_window512x3,...,fullx3``."""
        if len(self.groups) == 1 and self.groups[0].kind == "full":
            return ""
        return ",".join(g.tag() for g in self.groups)

    def load_start(self, g: int, start: int, end: int) -> int:
        """The first token of group ``g``'s blocks a hit ``[start, end)`` writes (block aligned)."""
        grp = self.groups[g]
        return max(start, grp.first_needed_block(end) * grp.block_size)


def part_key(key: bytes, part: int) -> bytes:
    """The store key of part ``part`` of the chunk keyed ``key``: the key itself for part 0."""
    if part == 0:
        return bytes(key)
    return hashlib.blake2b(bytes(key) + part.to_bytes(2, "little"), digest_size=len(key),
                           person=_PART_PERSON).digest()


def chain(keys: Sequence[bytes], parts: int) -> list[bytes]:
    """Every part of every chunk in chain order (chunk by chunk, part by part)."""
    if parts == 1:
        return [bytes(k) for k in keys]
    return [part_key(k, p) for k in keys for p in range(parts)]


def chain_parent(keys: Sequence[bytes], ci: int, part: int, parts: int | Sequence[int]) -> bytes | None:
    """The key before part ``part`` of chunk ``ci`` in the chain (None for the very first). ``parts``: how many
    parts every chunk chains (``0 .. parts - 1``), or which ones in chain order (``CacheGroups.chain_parts``)."""
    chained = range(parts) if isinstance(parts, int) else tuple(parts)
    j = chained.index(part)
    if j > 0:
        return part_key(keys[ci], chained[j - 1])
    return part_key(keys[ci - 1], chained[-1]) if ci > 0 else None


def saveable(block_ids: Sequence[int]) -> bool:
    """Whether a part's blocks all hold KV (none is vLLM's null block)."""
    return NULL_BLOCK not in block_ids


def cpu_mla_refusal(groups: CacheGroups | None, vllm_config: Any) -> str:
    """Why an MLA engine on the CPU cannot use a loaded prefix ("" when it can): vLLM's reference CPU MLA
    attention computes no prefill over a cached context, so vLLM turns chunked prefill and prefix caching
    off for it (``vllm/platforms/cpu.py``; the AMX MLA kernels keep both on)."""
    if groups is None or not groups.mla:
        return ""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    if device == "cpu" and not getattr(vllm_config.scheduler_config, "enable_chunked_prefill", True):
        return ("MLA on vLLM's reference CPU attention, which computes no prefill over a cached context (vLLM "
                "turned chunked prefill and prefix caching off for it): a loaded prefix would give wrong outputs")
    return ""


def check_overlay(groups: CacheGroups | None, kv_caches: dict[str, Any], first: Sequence[Any]) -> None:
    """With several groups: every group's registered views are ``first`` (the view group's tensors: vLLM
    overlays the groups in one allocation); a Mamba group's state tensors lie in the same allocation with the
    same block stride. ValueError (one line) otherwise."""
    if groups is None or not groups.hybrid:
        return

    def ident(t: Any) -> tuple:
        return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype

    def storage(t: Any) -> tuple:
        return t.untyped_storage().data_ptr(), t.stride(0) * t.element_size()

    want = {ident(t) for t in first}
    pages = [storage(t) for t in first]
    for gi, grp in enumerate(groups.groups):
        missing = [n for n in grp.layers if n not in kv_caches]
        if missing:
            raise ValueError(f"KV-cache group {gi} layer {missing[0]} was not registered")
        if grp.kind == "mamba":
            for i, n in enumerate(grp.layers):
                states = kv_caches[n] if isinstance(kv_caches[n], (list, tuple)) else [kv_caches[n]]
                if any(storage(t) != pages[i] for t in states):
                    raise ValueError(f"KV-cache group {gi} (Mamba state of {n}) does not lie in the pages of the "
                                     f"attention layers' allocation")
        elif {ident(kv_caches[n]) for n in grp.layers} != want:
            raise ValueError(f"KV-cache group {gi} does not overlay group {groups.view_group} in vLLM's allocation "
                             f"(its views are other tensors)")


def _group(spec: Any, layers: Sequence[str]) -> CacheGroup:
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                            SlidingWindowSpec, UniformTypeKVCacheSpecs)

    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {type(s) for s in spec.kv_cache_specs.values()}
        windows = {getattr(s, "sliding_window", 0) for s in spec.kv_cache_specs.values()}
        if len(kinds) != 1 or len(windows) != 1:
            raise UnsupportedGroups(f"a KV-cache group mixes {sorted(k.__name__ for k in kinds)} layers")
        spec = next(iter(spec.kv_cache_specs.values()))
    name = type(spec).__name__
    block = int(spec.block_size)
    if isinstance(spec, SlidingWindowMLASpec):
        raise UnsupportedGroups(f"{name} layers (sliding-window MLA) are not served")
    if isinstance(spec, SlidingWindowSpec):
        if int(getattr(spec, "extra_retained_tokens", 0) or 0):
            raise UnsupportedGroups(f"{name} keeps extra tokens beyond its window (speculative decoding)")
        return CacheGroup("sliding_window", tuple(layers), block, int(spec.sliding_window))
    if isinstance(spec, MLAAttentionSpec):
        if type(spec) is not MLAAttentionSpec:
            raise UnsupportedGroups(f"{name} layers are not served")
        return CacheGroup("mla", tuple(layers), block)
    if type(spec) is FullAttentionSpec:
        if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            raise UnsupportedGroups(f"{name} with a window or chunk inside one group is not served")
        return CacheGroup("full", tuple(layers), block)
    if isinstance(spec, MambaSpec):
        mode = str(getattr(spec, "mamba_cache_mode", "none"))
        if mode != "align":
            raise UnsupportedGroups(
                f"{name} layers in Mamba cache mode {mode!r} (one running state per request, none per block: "
                f"kvtier stores Mamba state only with vLLM's 'align' prefix caching)")
        if int(getattr(spec, "num_speculative_blocks", 0) or 0):
            raise UnsupportedGroups(f"{name} layers with speculative blocks (their states move in place)")
        return CacheGroup("mamba", tuple(layers), block)
    raise UnsupportedGroups(f"{name} layers are not served")


def cache_groups(kv_cache_config: "KVCacheConfig | None") -> CacheGroups | None:
    """The engine's groups (None when vLLM gave no config yet: one full-attention group is assumed);
    ``UnsupportedGroups`` for a group kvtier cannot serve."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    out = []
    for grp in groups:
        if getattr(grp, "is_eagle_group", False):
            raise UnsupportedGroups("a speculative-decoding draft (EAGLE/MTP) KV-cache group is not served")
        out.append(_group(grp.kv_cache_spec, grp.layer_names))
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise UnsupportedGroups(f"KV-cache groups with different block sizes {sorted(sizes)}")
    if all(g.kind == "mamba" for g in out):
        raise UnsupportedGroups("a model of Mamba state only (no attention layer whose pages kvtier copies)")
    counts = {len(g.layers) for g in out}
    if len(counts) > 1:
        raise UnsupportedGroups(f"KV-cache groups of unequal layer counts {sorted(counts)} (their pages would not "
                                f"overlay)")
    return CacheGroups(tuple(out))
