"""The cluster demo's plan (kvtier.demo.cluster_sizing): workload split per routing mode, per-replica
capacities from the per-replica miss-ratio curves."""

from __future__ import annotations

from collections import Counter

import pytest

from kvtier.demo.calibrate import PrefillProfile
from kvtier.demo.cluster_sizing import (ENGINE_MULTIPLE, LOCAL_MAX_SHARE, plan_cluster, split, sticky_replica)
from kvtier.demo.common import DEMO_CHUNK_TOKENS
from kvtier.workload.tokens import ApproxTokenizer

PROFILE = PrefillProfile(points=((256, 1.2), (1024, 5.8)), a=0.87, b=8.4e-5, c=4.6e-6,
                         decode_points=((1, 0.07), (4, 0.098)))


def test_split_roundrobin_alternates_and_sticky_keeps_conversations():
    order = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)]
    ids = ["a", "b", "c"]
    assert split(order, ids, 2, "roundrobin") == [0, 1, 0, 1, 0, 1]
    sticky = split(order, ids, 2, "sticky")
    for (ci, _), r in zip(order, sticky):
        assert r == sticky_replica(ids[ci], 2)
    assert Counter(sticky_replica(f"c{i}", 3) for i in range(300)).keys() == {0, 1, 2}


@pytest.mark.parametrize("workload", ["companion", "longdoc"])
@pytest.mark.parametrize("quick", [True, False])
def test_plan_capacities_hold_a_replicas_share_not_the_cluster(workload, quick):
    plan = plan_cluster(workload, quick, 2, ApproxTokenizer(), PROFILE, kv_bytes_per_token=46080)
    c = plan.capacities
    assert plan.facts.requests >= 15                     # a few dozen requests per run
    assert c.ssd_tokens <= LOCAL_MAX_SHARE * c.working_set_tokens + DEMO_CHUNK_TOKENS
    assert c.ram_tokens < c.ssd_tokens
    assert c.kv_cache_tokens >= plan.max_model_len             # vLLM refuses less
    ws_chunks = -(-c.working_set_tokens // DEMO_CHUNK_TOKENS)
    assert c.ssd_tokens >= DEMO_CHUNK_TOKENS * min(ENGINE_MULTIPLE * c.kv_cache_tokens // DEMO_CHUNK_TOKENS,
                                                   int(LOCAL_MAX_SHARE * ws_chunks))
    assert c.shared_tokens >= c.working_set_tokens
    assert all(t % DEMO_CHUNK_TOKENS == 0 for t in (c.kv_cache_tokens, c.ram_tokens, c.ssd_tokens, c.shared_tokens))
    assert c.to_dict()["ssd_bytes"] == c.ssd_tokens * 46080
    assert 0 <= plan.predicted["local/roundrobin"] <= 1 and 0 <= plan.predicted["local/sticky"] <= 1
    assert plan.run_s > 0
    assert plan.history == ("workload" if workload == "longdoc" else "live")
    assert plan.estimate_s(8, 3, 45.0, 17.0) > plan.estimate_s(4, 2, 45.0, 0.0)


def test_plan_is_seeded():
    a = plan_cluster("companion", True, 2, ApproxTokenizer(), PROFILE, 46080)
    b = plan_cluster("companion", True, 2, ApproxTokenizer(), PROFILE, 46080)
    assert [c.id for c in a.conversations] == [c.id for c in b.conversations]
    assert a.capacities == b.capacities


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        plan_cluster("poetry", True, 2, ApproxTokenizer(), PROFILE, 46080)
