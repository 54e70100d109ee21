"""Proof that a ``kvtier bench ttft`` row measured what its label says (side-effect free).

A "kvtier RAM hit" / "kvtier SSD hit" time counts only if, for that very request,
  - vLLM's prefix cache was emptied first (``reset_prefix_cache()`` returned True), so the hit
    cannot have come from vLLM's own cache;
  - vLLM itself reports the expected number of prompt tokens as cached (``num_cached_tokens``);
  - kvtier's own counters agree: the connector copied exactly those tokens into vLLM's blocks,
    every chunk read was served by the tier of that name and none by another tier (for a shared
    tier: none by this engine's own RAM or SSD; for a shared tier that does not count its reads —
    valkey, mooncake — the scheduler must have admitted the tokens from the shared tier, which with
    no local read leaves only it), and no load error was counted.
``verify_kvtier_hit`` returns the list of violations (empty = the row is what it claims).
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL_TIERS = ("memory", "disk")
SHARED_TIERS = ("sharedfs", "valkey", "mooncake")
TIERS = LOCAL_TIERS + SHARED_TIERS


def expected_hit_tokens(prompt_tokens: int, chunk_tokens: int, block_tokens: int) -> int:
    """Tokens a full kvtier hit loads: the prompt's whole chunks are stored, and vLLM takes whole
    blocks up to (not including) the last prompt token, so the last chunk may be used in part."""
    return min(prompt_tokens // chunk_tokens * chunk_tokens, (prompt_tokens - 1) // block_tokens * block_tokens)


@dataclass(frozen=True)
class HitEvidence:
    """What one timed request left behind (counter deltas are over that request only)."""

    expect_tokens: int                 # expected_hit_tokens(...)
    chunk_tokens: int
    reset_ok: bool | None              # reset_prefix_cache() before the request; None: not called
    vllm_cached_tokens: int | None     # RequestOutput.num_cached_tokens
    kvtier_delta: dict[str, float]     # kvtier_samples() after - before


def _sum(delta: dict[str, float], prefix: str, label: str | None = None) -> float:
    return sum(v for k, v in delta.items() if k.startswith(prefix + "{") or k == prefix
               if label is None or label in k)


def verify_kvtier_hit(ev: HitEvidence, tier: str) -> list[str]:
    """Violations of "these ``expect_tokens`` came from kvtier's ``tier``" (see the module doc)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    bad = []
    if ev.reset_ok is not True:
        bad.append(f"reset_prefix_cache() returned {ev.reset_ok}: the hit may be vLLM's own prefix cache")
    if ev.vllm_cached_tokens != ev.expect_tokens:
        bad.append(f"vLLM counted {ev.vllm_cached_tokens} cached tokens, expected {ev.expect_tokens}")
    d = ev.kvtier_delta
    loaded = _sum(d, "kvtier_connector_loaded_tokens_total")
    if loaded != ev.expect_tokens:
        bad.append(f"kvtier loaded {loaded:.0f} tokens into vLLM's blocks, expected {ev.expect_tokens}")
    chunks = -(-ev.expect_tokens // ev.chunk_tokens) if ev.chunk_tokens else 0   # a partly used chunk is read too
    served = _sum(d, "kvtier_store_hits_total", f"tier={tier}")
    if tier in SHARED_TIERS and served == 0 and not _sum(d, "kvtier_store_read_bytes_total", f"tier={tier}"):
        # a shared tier that does not count its reads (valkey, mooncake): the scheduler admitted the
        # tokens as shared-tier hits, and below no local tier served a read, so they came from it
        admitted = _sum(d, "kvtier_connector_hit_tokens_total", "tier=shared")
        if admitted != ev.expect_tokens:
            bad.append(f"{admitted:.0f} tokens admitted from the shared tier, expected {ev.expect_tokens}")
    elif served != chunks:
        bad.append(f"{served:.0f} chunk reads served by the {tier} tier, expected {chunks}")
    for other in TIERS:
        n = _sum(d, "kvtier_store_hits_total", f"tier={other}")
        if other != tier and n:
            bad.append(f"{n:.0f} chunk reads served by the {other} tier, not {tier}")
    errors = _sum(d, "kvtier_connector_errors_total")
    if errors:
        bad.append(f"{errors:.0f} connector load errors")
    return bad


def verify_prefix_cache_hit(expect_tokens: int, vllm_cached_tokens: int | None) -> list[str]:
    """Violations of "vLLM's own prefix cache served ``expect_tokens``" (the APC row)."""
    if vllm_cached_tokens is None or vllm_cached_tokens < expect_tokens:
        return [f"vLLM counted {vllm_cached_tokens} cached tokens, expected at least {expect_tokens}"]
    return []
