"""The cluster demo's plan (kvtier.demo.cluster_sizing, kvtier.demo.cluster_interleaving): workload split per
routing mode, per-replica capacities that hold a replica's share but not the cluster's working set, vLLM's own
KV space at the low point of every replica's round-robin curve (the published regime), seeded."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from kvtier.demo.calibrate import PrefillProfile, fit_profile
from kvtier.demo.cluster_interleaving import OVER_TARGET, candidate_size, choose_interleaving
from kvtier.demo.cluster_sizing import (ENGINE_MULTIPLE, LOCAL_MAX_SHARE, VANILLA_BOUND, VANILLA_TARGET,
                                        companion_sizes, default_runs, plan_cluster, split, sticky_replica)
from kvtier.demo.common import DEMO_CHUNK_TOKENS
from kvtier.workload.tokens import ApproxTokenizer
from tests.unit.memo_tokenizer import Encoded, MemoApproxTokenizer

PROFILE = PrefillProfile(points=((256, 1.2), (1024, 5.8)), a=0.87, b=8.4e-5, c=4.6e-6,
                         decode_points=((1, 0.07), (4, 0.098)))
# the 2-vCPU AVX2 machine's calibration (float32): 256 / 512 / 1024 tokens in 1.12 / 2.36 / 5.22 s
AVX2 = dataclasses.replace(fit_profile([(256, 1.122), (512, 2.357), (1024, 5.221)], elapsed_s=18.3),
                           decode_points=((1, 0.0924), (4, 0.1297)))
# a 2-vCPU AVX-512 bf16 machine's calibration: 256 / 512 / 1024 tokens in 0.34 / 0.74 / 1.83 s
AVX512 = dataclasses.replace(fit_profile([(256, 0.345), (512, 0.742), (1024, 1.835)], elapsed_s=5.7),
                             decode_points=((1, 0.028), (4, 0.0295)))
STARTUP_S = {"avx2": 46.8, "avx512": 25.1}
ENCODED = Encoded()          # the approximate tokenizer's texts, encoded once (tests/unit/memo_tokenizer.py)


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
    plan = plan_cluster(workload, quick, 2, MemoApproxTokenizer(ENCODED), PROFILE, kv_bytes_per_token=46080)
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
    for key in ("vanilla/roundrobin", "vanilla/sticky", "local/roundrobin", "local/sticky"):
        assert 0 <= plan.predicted[key] <= 1 and len(plan.predicted_per_replica[key]) == 2
    assert plan.predicted["vanilla/roundrobin"] <= plan.predicted["local/roundrobin"] <= plan.predicted["ideal"]
    assert plan.run_s > 0 and plan.run_s == max(plan.run_estimates.values())
    assert plan.history == ("workload" if workload == "longdoc" else "live")
    assert plan.estimate_s(default_runs(False), 45.0, 17.0) > plan.estimate_s(default_runs(True), 45.0, 0.0)


@pytest.fixture(scope="module", params=[("avx2", True), ("avx2", False), ("avx512", True), ("avx512", False)],
                ids=lambda p: f"{p[0]}-{'quick' if p[1] else 'default'}")
def sized(request):
    cpu, quick = request.param
    profile = AVX2 if cpu == "avx2" else AVX512
    base = companion_sizes()["quick" if quick else "default"]
    return cpu, quick, choose_interleaving(base, 2, MemoApproxTokenizer(ENCODED), profile, 46080,
                                           runs=default_runs(quick),
                                           startup_s=STARTUP_S[cpu], calibration_s=profile.elapsed_s)


def test_vanillas_engine_kv_sits_at_the_curves_low_point(sized):
    """The published regime: vLLM's own KV space (its floor: one full request and a block) is where every
    replica's round-robin curve predicts a low hit rate, on both CPU classes, default and quick."""
    _, _, it = sized
    plan = it.plan
    per = plan.predicted_per_replica["vanilla/roundrobin"]
    assert it.chosen.reached
    assert plan.predicted["vanilla/roundrobin"] <= VANILLA_TARGET
    assert max(per) <= VANILLA_BOUND
    assert plan.capacities.kv_cache_tokens < plan.max_model_len + 2 * DEMO_CHUNK_TOKENS      # at its floor
    # the tiers keep their roles: local below the working set, shared above it, far above vanilla
    c = plan.capacities
    assert c.ssd_tokens < c.working_set_tokens <= c.shared_tokens
    assert plan.predicted["local/roundrobin"] > 3 * plan.predicted["vanilla/roundrobin"]
    assert plan.predicted["local/roundrobin"] < 0.8 * plan.predicted["ideal"]


def test_the_estimate_fits_or_says_by_how_much(sized):
    cpu, quick, it = sized
    d = it.plan.sizing
    assert d["users"] == it.plan.concurrency and d["estimate_s"] == it.chosen.estimate_s
    if it.chosen.fits:
        assert it.chosen.estimate_s <= OVER_TARGET * it.target_s and d["over_target_s"] == 0.0
    else:
        assert d["over_target_s"] > 0 and "min over the" in d["problem"]
    if cpu == "avx512":          # the faster class keeps its targets (15 / 6 minutes)
        assert it.chosen.fits


def test_a_few_interleaved_users_do_not_reach_the_regime():
    """The earlier sizes (8 users, 14 conversations default; 6 and 8 quick) put vanilla far above the bound."""
    for key in ("default", "quick"):
        base = companion_sizes()[key]
        it = choose_interleaving(base, 2, MemoApproxTokenizer(ENCODED), AVX512, 46080,
                                 runs=default_runs(key == "quick"))
        first = it.tried[0]
        assert first.users == base.concurrency and first.vanilla_rr > VANILLA_BOUND


def test_candidate_sizes_scale_lengths_and_interleave_more_conversations_than_users():
    base = companion_sizes()["default"]
    s = candidate_size(base, 0.5, 20)
    assert (s.concurrency, s.conversations) == (20, 30)
    assert s.system_tokens == round(base.system_tokens * 0.5) and s.max_prompt_tokens == round(base.max_prompt_tokens * 0.5)


def test_plan_is_seeded():
    # (and the memoised tokenizer the other tests use plans exactly what the plain one does)
    a = plan_cluster("companion", True, 2, MemoApproxTokenizer(ENCODED), PROFILE, 46080)
    b = plan_cluster("companion", True, 2, ApproxTokenizer(), PROFILE, 46080)
    assert [c.id for c in a.conversations] == [c.id for c in b.conversations]
    assert a.capacities == b.capacities and a.sizing == b.sizing


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        plan_cluster("poetry", True, 2, MemoApproxTokenizer(ENCODED), PROFILE, 46080)
