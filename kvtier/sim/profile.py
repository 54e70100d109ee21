"""The simulator's profile: engine costs, cache sizes and tier speeds (pydantic, YAML).

A profile describes one serving machine: how long vLLM's steps take (fitted by
``kvtier calibrate`` or taken from a preset), its prefix-cache size, and kvtier's tiers
(capacity, bandwidth, per-operation latency). Every field is documented in
docs/simulator.md. ``load_profile`` raises ``ProfileError`` with one line naming the field.

Step-time model (one vLLM engine step, seconds)::

    step = step_overhead_s + prefill_token_s * P + prefill_attn_s * A
           + decode_seq_s * D + decode_ctx_s * C + (synchronous kvtier loads in the step)

P = prefill tokens in the step, A = attention pairs of those tokens (each new token
attends to its context: cached + earlier new tokens), D = decoding sequences, C = their
total context tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.config import ByteSize, ConfigError, read_yaml_mapping


class ProfileError(ValueError):
    """A bad profile file or value; one line naming the field."""


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineProfile(_M):
    block_size: int = Field(default=16, ge=1, description="vLLM KV block size (tokens)")
    max_num_batched_tokens: int = Field(default=8192, ge=1, description="token budget of one engine step")
    max_num_seqs: int = Field(default=256, ge=1, description="most running requests")
    kv_cache_tokens: int = Field(default=1_000_000, ge=0, description="vLLM KV cache (prefix cache) size in tokens")
    prefix_caching: bool = Field(default=True, description="vLLM's automatic prefix caching")
    preemption: bool = Field(default=True, description="KV blocks allocated as tokens are computed, recompute "
                             "preemption when full (vLLM v1); false: prompt + output reserved at admission")
    step_overhead_s: float = Field(default=0.004, ge=0)
    prefill_token_s: float = Field(default=5e-5, ge=0)
    prefill_attn_s: float = Field(default=0.0, ge=0)
    decode_seq_s: float = Field(default=1e-4, ge=0)
    decode_ctx_s: float = Field(default=0.0, ge=0)
    request_overhead_s: float = Field(default=0.0, ge=0, description="fixed client-visible latency per request")


class TierProfile(_M):
    capacity: ByteSize = Field(default=0, description="bytes; 0 = tier off")
    read_bw: float = Field(default=10e9, gt=0, description="bytes/s of a load into the engine")
    write_bw: float = Field(default=5e9, gt=0, description="bytes/s (background; limits nothing on the critical path)")
    op_latency_s: float = Field(default=0.0, ge=0, description="fixed cost of one batched read")
    chunk_latency_s: float = Field(default=0.0, ge=0, description="extra cost per chunk read")


class SimProfile(_M):
    description: str = ""
    source: str = Field(default="", description="how the numbers were obtained")
    kv_bytes_per_token: int = Field(default=131072, ge=1)
    chunk_size: int = Field(default=256, ge=1, description="kvtier chunk tokens (multiple of the block size)")
    eviction: Literal["lru", "cost"] = "lru"
    promote_min_hits: int = Field(default=2, ge=1, description="SSD/shared hits before a chunk is copied to RAM")
    save: bool = Field(default=True, description="kvtier saves newly computed chunks (off: no kvtier)")
    ram_view: Literal["exact", "stored_keys"] = Field(
        default="exact", description="what vLLM's scheduler knows of the worker's RAM tier: exact (kvtier since "
        "2026-12-01: stored, promoted and evicted keys reported) or stored_keys (the connector of 2026-11-30: "
        "the last RAM-capacity keys reported stored; kvtier.sim.ram_view)")
    engine: EngineProfile = EngineProfile()
    ram: TierProfile = TierProfile()
    ssd: TierProfile = TierProfile(read_bw=3e9, write_bw=2e9, op_latency_s=1e-4)
    shared: TierProfile = TierProfile(read_bw=1.2e9, write_bw=1e9, op_latency_s=1e-3)

    def kvtier_enabled(self) -> bool:
        return self.save and (self.ram.capacity > 0 or self.ssd.capacity > 0 or self.shared.capacity > 0)


def _first_error(err: ValidationError, where: str) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "profile"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{where}: {loc}: {msg}"


def profile_from_dict(data: dict, where: str = "profile") -> SimProfile:
    try:
        return SimProfile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(_first_error(e, where)) from None


def load_profile(path: str | Path) -> SimProfile:
    """Read a profile YAML file; ProfileError (one line) on any problem."""
    try:
        data = read_yaml_mapping(path)
    except ConfigError as e:
        raise ProfileError(str(e).replace("config file", "profile")) from None
    return profile_from_dict(data, str(path))


def save_profile(profile: SimProfile, path: str | Path) -> Path:
    """Write atomically (temp file + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    tmp.replace(p)
    return p
