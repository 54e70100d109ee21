"""Mamba / linear-attention state in vLLM's "align" prefix-cache mode: a Mamba group is a part of every
chunk (one block: the state at the chunk's end, from the exact block vLLM offers for that boundary); a hit
loads only the state at its end; state pages lie in the attention layers' allocation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from kvtier.integrations.vllm.cache_groups import (UnsupportedGroups, cache_groups, check_overlay,
                                                   part_key)
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.step_plans import boundary_states
from kvtier.keys import Namespace, chunk_keys
from tests.unit.test_cache_groups import GroupTables
from tests.unit.test_connector_sides import FakeRequest, FakeStore, _prompt

BLOCK = 128
NS = Namespace(model="m", model_fingerprint="f", dtype="bfloat16", layout="lbhnc/mambax1,fullx1", block_size=BLOCK,
               chunk_size=BLOCK)


def _mamba(mode="align", spec_blocks=0):
    return MambaSpec(block_size=BLOCK, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode=mode,
                     num_speculative_blocks=spec_blocks)


def _full():
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _config(*specs):
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{g}.x"], spec)
                                            for g, spec in enumerate(specs)])


def test_align_mode_state_is_a_group_the_others_are_refused():
    groups = cache_groups(_config(_mamba(), _mamba(), _full()))
    assert [g.kind for g in groups.groups] == ["mamba", "mamba", "full"]
    assert groups.mamba and groups.sparse and groups.loads_whole and groups.view_group == 2
    assert groups.signature() == "mambax1,mambax1,fullx1"
    assert groups.groups[0].first_needed_block(768) == 5 and groups.groups[2].first_needed_block(768) == 0
    with pytest.raises(UnsupportedGroups, match="Mamba cache mode 'none'"):
        cache_groups(_config(_mamba("none"), _full()))
    with pytest.raises(UnsupportedGroups, match="speculative blocks"):
        cache_groups(_config(_mamba(spec_blocks=1), _full()))
    with pytest.raises(UnsupportedGroups, match="Mamba state only"):
        cache_groups(_config(_mamba(), _mamba()))


def _scheduler(store):
    groups = cache_groups(_config(_mamba(), _full()))
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, groups=groups)
    tables = GroupTables()        # group 0 (Mamba) gets the null block before ``null_before``
    s.bind(tables)
    return s, tables


def _offers(req_id, *entries):
    """vLLM's ``KVConnectorBlockState.boundary_state_offloads`` of a step: (group, block, tokens)."""
    return SimpleNamespace(boundary_state_offloads={req_id: list(entries)})


def test_chunks_save_their_attention_and_the_states_vllm_offers_as_leaves():
    store, tokens = FakeStore(), _prompt(700)
    keys = chunk_keys(NS, tokens)
    s, tables = _scheduler(store)
    req = FakeRequest("a", tokens)
    s.after_alloc(req, s.num_new_matched_tokens(req, 0))
    mamba, full = tables.alloc("a", 256)
    step = SimpleNamespace(num_scheduled_tokens={"a": 256},
                           kv_connector_block_state=_offers("a", (0, 77, 128), (0, 78, 256)))
    meta = s.build_meta(step)
    req.num_computed_tokens = 256
    att = [part_key(k, 1) for k in keys]
    assert [(c.key, c.parent, c.block_ids) for c in meta.saves] == [
        (att[0], None, (full[0],)), (att[1], att[0], (full[1],)),                      # the chain
        (part_key(keys[0], 0), att[0], (77,)), (part_key(keys[1], 0), att[1], (78,))]  # states: leaves
    tables.alloc("a", 512)
    step = SimpleNamespace(num_scheduled_tokens={"a": 256},
                           kv_connector_block_state=_offers("a", (0, 80, 512)))     # no state kept at 384
    assert [(c.key, c.block_ids) for c in s.build_meta(step).saves] == [
        (att[2], (full[2],)), (att[3], (full[3],)), (part_key(keys[3], 0), (80,))]
    req.num_computed_tokens = 512
    step = SimpleNamespace(num_scheduled_tokens={"a": 1}, kv_connector_block_state=_offers("a", (0, 80, 512)))
    assert s.build_meta(step).saves == []                                          # each state once


def _held(store, keys, chained: int, states=()):
    for k in keys[:chained]:
        store.data[part_key(k, 1)] = b"x"
    for c in states:
        store.data[part_key(keys[c], 0)] = b"x"


@pytest.mark.parametrize("states, claim", [((4,), 640), ((2,), 384), ((1, 2), 384), ((0,), 128), ((), 0)])
def test_a_hit_ends_at_the_last_chunk_whose_state_is_held(states, claim):
    store, tokens = FakeStore(), _prompt(700)
    _held(store, chunk_keys(NS, tokens), 5, states)
    s, _ = _scheduler(store)
    assert s.num_new_matched_tokens(FakeRequest("a", tokens), 0) == claim


def test_a_hit_loads_every_attention_block_and_only_the_state_at_its_end():
    store, tokens = FakeStore(), _prompt(700)
    keys = chunk_keys(NS, tokens)
    _held(store, keys, 5, (4,))
    s, tables = _scheduler(store)
    req = FakeRequest("a", tokens)
    claim = s.num_new_matched_tokens(req, 0)
    assert claim == 640 and s.load_async(req)
    s.after_alloc(req, claim)
    mamba, full = tables.alloc("a", claim, null_before=4)        # vLLM keeps the state block 4 only
    (plan,) = s.build_meta(SimpleNamespace(num_scheduled_tokens={})).loads
    assert plan.whole and [(c.key, c.block_ids) for c in plan.chunks] == \
        [(part_key(keys[i], 1), (full[i],)) for i in range(5)] + [(part_key(keys[4], 0), (mamba[4],))]
    req2 = FakeRequest("b", tokens)
    s.after_alloc(req2, s.num_new_matched_tokens(req2, 0))
    tables.alloc("b", claim, null_before=5)                       # no block for the state: no load
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={})).loads == []


def test_boundary_states_are_read_from_vllms_block_state():
    step = SimpleNamespace(kv_connector_block_state=_offers("a", (0, 7, 128), (2, 9, 128)))
    assert boundary_states(step) == {"a": {(0, 128): 7, (2, 128): 9}}
    assert boundary_states(SimpleNamespace()) == {} and boundary_states(SimpleNamespace(kv_connector_block_state=None)) == {}


def test_state_tensors_must_lie_in_the_attention_pages():
    groups = cache_groups(_config(_mamba(), _full()))
    raw = torch.zeros(10, 2, BLOCK, 16)                                  # 10 pages of the full-attention view
    flat = raw.view(-1)
    conv = flat.as_strided((10, 3, 8), (raw.stride(0), 8, 1))            # state tensors in the same pages
    ssm = flat.as_strided((10, 4, 4), (raw.stride(0), 4, 1), 24)
    kv = {"model.layers.0.x": [conv, ssm], "model.layers.1.x": raw}
    check_overlay(groups, kv, [raw])
    kv["model.layers.0.x"] = [conv, torch.zeros(10, 4, 4)]               # a state tensor of its own
    with pytest.raises(ValueError, match="does not lie in the pages"):
        check_overlay(groups, kv, [raw])


class SharedStore(FakeStore):
    """Local chunks in ``data``, a shared tier's in ``shared`` (answered at once, off the scheduler's loop)."""

    def __init__(self):
        super().__init__()
        self.shared: set[bytes] = set()

    def has_remote(self):
        return True

    def shared_prefix(self, keys, deadline=None):
        n = 0
        for k in keys:
            if k not in self.shared:
                break
            n += 1
        return SimpleNamespace(num_chunks=n, status=None, tiers=("shared",) * n)


def _ask(s, req, tries=200):
    import time

    for _ in range(tries):
        got = s.num_new_matched_tokens(req, 0)
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("the shared tier's answer never came")


@pytest.mark.parametrize("shared_state, claim", [(True, 640), (False, 256)])
def test_a_hit_reaching_into_the_shared_tier_needs_its_state_there(shared_state, claim):
    """Chunks 0-1 local (a state at chunk 1's end), 2-4 only in the shared tier: the hit reaches chunk 4 when the
    shared tier holds chunk 4's state, else it ends at the last local chunk with a state."""
    store, tokens = SharedStore(), _prompt(700)
    keys = chunk_keys(NS, tokens)
    _held(store, keys, 2, (1,))
    store.shared = {part_key(k, 1) for k in keys[2:5]} | ({part_key(keys[4], 0)} if shared_state else set())
    s, _ = _scheduler(store)
    req = FakeRequest("a", tokens)
    assert _ask(s, req) == claim
    s.finished(req)
    assert not s._remote._q                                       # its state query is forgotten too
