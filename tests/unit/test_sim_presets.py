"""Presets: KV bytes per token from the model shapes, profiles that load, clear errors."""

from __future__ import annotations

import pytest

from kvtier.sim.presets import MODELS, make_preset, preset_names, resolve_profile
from kvtier.sim.profile import ProfileError


def test_kv_bytes_per_token_from_shapes() -> None:
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert MODELS["qwen2.5-7b"].kv_bytes_per_token == 57344
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 327680
    assert MODELS["deepseek-v3"].kv_bytes_per_token == 61 * 576 * 2     # MLA latent + rope, bf16


def test_presets_resolve_and_scale_with_the_accelerator() -> None:
    h100, l20 = resolve_profile("h100/llama-3-8b"), resolve_profile("l20/llama-3-8b")
    assert h100.kv_bytes_per_token == 131072 and h100.engine.kv_cache_tokens > 100_000
    assert l20.engine.prefill_token_s > 5 * h100.engine.prefill_token_s      # ~8x fewer FLOP/s
    assert resolve_profile("h200/llama-3-8b").engine.kv_cache_tokens > h100.engine.kv_cache_tokens
    assert resolve_profile("t4/qwen2.5-1.5b").engine.kv_cache_tokens > 0
    assert len(preset_names()) == 20


def test_unknown_or_impossible_presets_are_one_line_errors() -> None:
    with pytest.raises(ProfileError, match="unknown profile"):
        resolve_profile("h900/llama-3-8b")
    with pytest.raises(ProfileError, match="does not fit"):
        make_preset("t4", "llama-3-8b")
