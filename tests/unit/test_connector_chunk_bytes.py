"""The connector sizes chunks with kvtier.compute's one KV formula, from vLLM's model config and KV dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.compute import kv_bytes  # noqa: E402
from kvtier.integrations.vllm.connector import _chunk_bytes  # noqa: E402


def _cfg(dtype, cache_dtype="auto"):
    mc = SimpleNamespace(dtype=dtype, get_num_layers=lambda pc: 30, get_num_kv_heads=lambda pc: 3,
                         get_head_size=lambda: 64)
    return SimpleNamespace(model_config=mc, parallel_config=None,
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype))


@pytest.mark.parametrize("dtype,item", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_chunk_bytes_follow_the_model_dtype(dtype, item):
    assert _chunk_bytes(_cfg(dtype), 256) == kv_bytes(30, 3, 64, item, tokens=256)


def test_chunk_bytes_follow_an_fp8_kv_cache():
    # the old copy guessed the item size from "16" in the *model* dtype and ignored cache_dtype
    assert _chunk_bytes(_cfg(torch.bfloat16, "fp8_e4m3"), 256) == kv_bytes(30, 3, 64, 1, tokens=256)


def test_chunk_bytes_exotic_config_is_a_conservative_default():
    assert _chunk_bytes(SimpleNamespace(), 256) == 1 << 20
