"""What the connector tells vLLM about layouts and CUDA graphs, and the payload layout each resolved
vLLM layout gives the namespace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.integrations.vllm.connector import KvtierConnector
from kvtier.integrations.vllm.namespace import engine_layout
from kvtier.transfer.page_layout import LayoutError


def test_asks_vllm_for_lbhnc():
    assert KvtierConnector.get_required_kvcache_layout(SimpleNamespace()) == "LBHNC"


@pytest.mark.parametrize("mode,piecewise", [("layerwise", True), ("whole", False)])
def test_layer_pipelined_loads_need_piecewise_cuda_graphs(mode, piecewise):
    extra = {"kvtier_config": {"connector": {"load_mode": mode}}}
    assert KvtierConnector.requires_piecewise_for_cudagraph(extra) is piecewise


def _configs(resolved, in_kv_cache_config=True):
    cache = SimpleNamespace(kv_cache_layout=None if in_kv_cache_config else resolved)
    kv_cache_config = SimpleNamespace(kv_cache_layout=resolved if in_kv_cache_config else None)
    return SimpleNamespace(cache_config=cache), kv_cache_config


@pytest.mark.parametrize("resolved,payload", [("LBHNC", "lbhnc"), ("HND", "lbhnc"), ("LBNHC", "lbnhc"),
                                              ("NHD", "lbnhc"), ("BLHNC", "lbhnc"), ("BLNHC", "lbnhc"),
                                              (None, "lbhnc")])
def test_payload_layout_follows_the_resolved_layout(resolved, payload):
    for where in (True, False):
        assert engine_layout(*_configs(resolved, where)).name == payload


@pytest.mark.parametrize("resolved", ["LHBNC", "BHLNC"])
def test_layouts_without_dense_pages_are_refused(resolved):
    with pytest.raises(LayoutError, match=f"{resolved} does not keep a block of one layer in one dense page"):
        engine_layout(*_configs(resolved))
