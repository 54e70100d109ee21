"""The tier's namespace and keys: vLLM's ``OffloadKey``s never alias kvtier's own connector's chunks,
and every field that changes a primary chunk's bytes changes the namespace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import make_offload_key

from kvtier.config import StoreConfig
from kvtier.integrations.vllm_tiering.keymap import KeyMap
from kvtier.integrations.vllm_tiering.namespace import (
    LAYOUT_PREFIX,
    chunk_tokens,
    offload_chunk_key,
    offload_namespace,
)
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import TieredStore
from kvtier.transfer.page_layout import PageLayout
from tests.unit import vllm_tiering_rig as rig

CFG = rig.offloading_config()
NS = offload_namespace(CFG, 64 * 1024)


def _connector_namespace(layout: str) -> Namespace:
    """The namespace kvtier's own connector would derive for the same engine (same model, dtype,
    block and chunk size), in either payload layout it writes."""
    return Namespace(model=NS.model, model_fingerprint=NS.model_fingerprint, dtype=NS.dtype, layout=layout,
                     block_size=NS.block_size, chunk_size=NS.chunk_size)


def test_the_layout_is_no_connector_layout():
    assert NS.layout.startswith(LAYOUT_PREFIX + ":")
    with pytest.raises(ValueError):
        PageLayout.parse(NS.layout)
    for layout in ("lbhnc", "lbnhc"):
        assert _connector_namespace(layout).digest() != NS.digest()


@settings(max_examples=200, deadline=None)
@given(block_hash=st.binary(min_size=1, max_size=64), group=st.integers(0, 7),
       tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=48), layout=st.sampled_from(["lbhnc", "lbnhc"]))
def test_an_offload_key_never_aliases_a_connector_chunk(block_hash, group, tokens, layout):
    ok = make_offload_key(block_hash, group)
    tier_key = offload_chunk_key(NS, ok)
    assert tier_key not in chunk_keys(_connector_namespace(layout), tokens)
    assert tier_key not in chunk_keys(NS, tokens)          # not even under the tier's own namespace digest
    assert tier_key == offload_chunk_key(offload_namespace(CFG, 64 * 1024), ok)   # deterministic
    assert tier_key != offload_chunk_key(NS, make_offload_key(block_hash, group + 1))   # groups apart


@pytest.mark.parametrize("change", [
    lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, name="other/model")),
    lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, dtype="float16")),
    lambda c: dataclasses.replace(c, kv_cache_layout="HND"),
    lambda c: dataclasses.replace(c, canonical_layout=True),
    lambda c: dataclasses.replace(c, cache=dataclasses.replace(c.cache, blocks_per_chunk=2)),
    lambda c: dataclasses.replace(c, groups=(dataclasses.replace(c.groups[0], layer_names=("x",)),)),
    lambda c: dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, tp_size=2)),
    lambda c: dataclasses.replace(c, worker_kv_bytes_per_block=32 * 1024),
], ids=["model", "dtype", "kv_layout", "canonical", "chunk_tokens", "layers", "tp", "worker_bytes"])
def test_every_field_that_changes_the_bytes_changes_the_namespace(change):
    assert offload_namespace(change(CFG), 64 * 1024).digest() != NS.digest()


def test_chunk_size_and_deployment_are_in_the_namespace():
    assert offload_namespace(CFG, 128 * 1024).digest() != NS.digest()
    assert offload_namespace(CFG, 64 * 1024, deployment="blue").digest() != NS.digest()
    assert chunk_tokens(dataclasses.replace(CFG, cache=dataclasses.replace(CFG.cache, blocks_per_chunk=4))) == 64


def test_a_connector_store_on_the_same_directory_never_sees_the_tiers_chunks(tmp_path: Path):
    """Both on one SSD directory: each namespace has its own sub-directory and its own keys."""
    cfg = StoreConfig.model_validate({"chunk_size": 16, "memory": {"enabled": False},
                                      "disk": {"enabled": True, "path": str(tmp_path)}})
    ok = make_offload_key(b"\x01" * 32, 0)
    tier_store = TieredStore.open(cfg, NS)
    try:
        km = KeyMap(NS)
        assert tier_store.put(km.chunk_key(ok), None, b"\x07" * 4096, num_tokens=16, shape=(4096,), dtype="uint8")
        assert tier_store.flush(10)
    finally:
        tier_store.close()
    conn = TieredStore.open(cfg, _connector_namespace("lbhnc"))
    try:
        assert conn.disk.keys() == []
        assert conn.get(offload_chunk_key(NS, ok)) is None
    finally:
        conn.close()


def test_the_key_map_remembers_recent_keys_for_events():
    km = KeyMap(NS, capacity=2)
    a, b, c = (make_offload_key(bytes([i]) * 32, 0) for i in range(3))
    cka, ckb, ckc = (km.stored_key(k) for k in (a, b, c))
    assert km.offload_keys([ckc, cka, ckb]) == [c, b]     # a fell out of the window
    km.chunk_keys([make_offload_key(bytes([i]) * 32, 1) for i in range(5)])   # lookups: nothing remembered
    assert km.offload_keys([ckb, ckc]) == [b, c] and len(km) == 2
    with pytest.raises(ValueError):
        KeyMap(NS, capacity=0)
