"""The cluster behind one load and a router (``kvtier.sim.cluster.run_cluster``): one replica is
the single engine whatever the routing; requests add up; sticky keeps a conversation on one
replica; round-robin follows the send order; kv-aware follows the cached prefix; a shared tier
serves one replica's prefixes to the others and its reads are counted."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier.sim.cluster import run_cluster
from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile
from kvtier.sim.routing import sdbm
from kvtier.sim.run import simulate
from kvtier.sim.trace import load_mooncake_raw, load_workload_trace
from kvtier.workload.companion import CompanionSpec, generate_companion
from kvtier.workload.format import write_workload

FIELDS = ("sent", "ok", "send_s", "ttft_s", "e2e_s", "cached_tokens", "load_s")


def mooncake(path: Path, n: int, prefixes: int, seed: int, rate: float = 3.0) -> Path:
    rng = random.Random(seed)
    pool = [[(p << 20) | j for j in range(rng.randrange(1, 6))] for p in range(prefixes)]
    nxt, t, lines = 1 << 40, 0.0, []
    for _ in range(n):
        ids = pool[rng.randrange(prefixes)] + list(range(nxt, nxt + rng.randrange(1, 3)))
        nxt += 4
        t += rng.expovariate(rate) * 1000
        lines.append(json.dumps({"timestamp": int(t), "input_length": len(ids) * 512 - rng.randrange(300),
                                 "output_length": rng.randrange(1, 60), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def prof(kv_tokens: int = 30 * 512, ram: int = 0, ssd: int = 0, shared: int = 0, save: bool = True,
         preemption: bool = True) -> SimProfile:
    return SimProfile(kv_bytes_per_token=1000, chunk_size=512, save=save,
                      engine=EngineProfile(block_size=16, max_num_batched_tokens=2048, max_num_seqs=16,
                                           kv_cache_tokens=kv_tokens, preemption=preemption, step_overhead_s=0.004,
                                           prefill_token_s=4e-5, decode_seq_s=2e-5, decode_ctx_s=5e-8,
                                           request_overhead_s=0.002),
                      ram=TierProfile(capacity=ram, read_bw=20e9), ssd=TierProfile(capacity=ssd, read_bw=5e9),
                      shared=TierProfile(capacity=shared, read_bw=2e9, op_latency_s=5e-4))


def companion(tmp: Path, conversations: int = 12, seed: int = 5):
    spec = CompanionSpec(conversations=conversations, turns_mean=4, turns_max=8, personas=3, system_tokens=400,
                         user_tokens=30, assistant_tokens=60, max_prompt_tokens=3000, resume_fraction=0.3,
                         think_time_s=2.0, seed=seed)
    p = tmp / f"comp{seed}.jsonl"
    write_workload(p, *generate_companion(spec))
    return load_workload_trace(p, unit_tokens=16, tokenizer=None)


def comp_prof(ram: int = 0, shared: int = 0, kv_tokens: int = 4000) -> SimProfile:
    p = prof(kv_tokens, ram=ram, shared=shared)
    return p.model_copy(update={"chunk_size": 256})


LOADS = st.sampled_from([LoadSpec(mode="trace"), LoadSpec(mode="closed", concurrency=3),
                         LoadSpec(mode="open", rate=4.0, seed=2), LoadSpec(mode="closed", concurrency=8,
                                                                           think_time_scale=0.0)])
PROFILES = st.sampled_from([prof(ram=10 * 512 * 1000, ssd=40 * 512 * 1000), prof(8 * 512, ram=20 * 512 * 1000),
                            prof(shared=50 * 512 * 1000, preemption=False), prof(save=False),
                            prof(12 * 512, ram=6 * 512 * 1000, shared=30 * 512 * 1000)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), load=LOADS, p=PROFILES, routing=st.sampled_from(["roundrobin", "sticky",
                                                                                      "kv-aware"]))
def test_one_replica_is_the_single_engine_whatever_the_routing(tmp_path, seed, load, p, routing) -> None:
    tr = load_mooncake_raw(mooncake(tmp_path / f"m{seed}.jsonl", 80, 6, seed))
    alone = simulate(tr, p, load).result
    c = run_cluster(tr, p, load, 1, routing)
    for f in FIELDS:
        assert np.array_equal(getattr(alone, f), getattr(c.result, f), equal_nan=True), f
    for k in alone.tier_tokens:
        assert np.array_equal(alone.tier_tokens[k], c.result.tier_tokens[k]), k
    assert c.result.steps == alone.steps and c.duration_s == alone.duration_s
    assert c.requests == int(alone.ok.sum())


def test_one_replica_is_the_single_engine_on_a_multi_turn_workload(tmp_path) -> None:
    tr = companion(tmp_path)
    for load in (LoadSpec(mode="closed", concurrency=4), LoadSpec(mode="open", rate=0.5)):
        p = comp_prof(ram=200 * 256 * 1000)
        alone = simulate(tr, p, load).result
        c = run_cluster(tr, p, load, 1, "sticky")
        for f in FIELDS:
            assert np.array_equal(getattr(alone, f), getattr(c.result, f), equal_nan=True), f


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 5), load=LOADS, p=PROFILES,
       routing=st.sampled_from(["roundrobin", "sticky", "kv-aware"]))
def test_requests_add_up_and_every_request_is_served_once(tmp_path, seed, n, load, p, routing) -> None:
    tr = load_mooncake_raw(mooncake(tmp_path / f"m{seed}.jsonl", 60, 5, seed))
    c = run_cluster(tr, p, load, n, routing)
    assert sum(r.requests for r in c.per_replica) == c.requests == int(c.result.ok.sum())
    assert c.sent == int((c.route >= 0).sum()) == int(c.result.sent.sum())
    assert c.failed == c.sent - c.requests
    if load.mode in ("trace", "open"):
        assert c.sent == tr.num_requests            # every conversation's start is sent
    sh = sum(r.shared_bytes_read for r in c.per_replica)
    assert sh == c.shared_bytes_read and (sh == 0 or c.shared)
    if c.shared:                                    # one unit per chunk: shared tokens are whole chunks read
        assert sh >= int(c.result.tier_tokens["shared"].sum()) * 1000
    assert c.ttft_p50_s is None or c.ttft_p50_s <= c.ttft_p90_s


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000), n=st.integers(2, 5), users=st.integers(1, 8))
def test_sticky_keeps_a_conversation_on_one_replica(tmp_path, seed, n, users) -> None:
    tr = companion(tmp_path, conversations=16, seed=seed)
    c = run_cluster(tr, comp_prof(ram=100 * 256 * 1000), LoadSpec(mode="closed", concurrency=users), n, "sticky")
    conv_of = np.repeat(np.arange(tr.num_conversations), np.diff(tr.conv_offsets))
    for k in range(tr.num_conversations):
        got = set(c.route[(conv_of == k) & (c.route >= 0)].tolist())
        assert got <= {sdbm(tr.conv_ids[k].encode()) % n}
    assert c.requests == tr.num_requests           # closed loop: every turn of every conversation is served


def test_peak_shared_bandwidth_is_the_busiest_window() -> None:
    from kvtier.sim.planner import peak_shared_bw
    from kvtier.sim.result import SimResult
    n = 4
    z = np.zeros(n, dtype=np.int64)
    res = SimResult(sent=np.ones(n, bool), ok=np.array([True, True, True, False]),
                    send_s=np.array([0.0, 50.0, 50.5, 60.0]), ttft_s=np.array([0.5, 0.2, 0.2, np.nan]),
                    e2e_s=np.ones(n), cached_tokens=z, tier_tokens={"gpu": z, "ram": z, "ssd": z,
                                                                   "shared": np.array([10, 20, 30, 99])},
                    load_s=np.zeros(n), output_tokens=z, duration_s=200.0, steps=1, counters={})
    # 100 windows of 2 s: requests 1 and 2 (first tokens at 50.2 and 50.7 s) share one, 50 tokens x 8 B
    assert peak_shared_bw(res, 8, 200.0) == pytest.approx(50 * 8 / 2.0)


def test_sdbm_is_haproxys_hash() -> None:
    # hash_sdbm from HAProxy's src/hash.c, computed by hand for short inputs
    assert sdbm(b"") == 0
    assert sdbm(b"a") == 97
    assert sdbm(b"ab") == (98 + (97 << 6) + (97 << 16) - 97) & 0xFFFFFFFF


def test_roundrobin_follows_the_send_order(tmp_path) -> None:
    tr = companion(tmp_path)
    c = run_cluster(tr, comp_prof(), LoadSpec(mode="closed", concurrency=5), 4, "roundrobin")
    sent = np.flatnonzero(c.route >= 0)
    order = sent[np.lexsort((sent, c.result.send_s[sent]))]
    assert c.route[order].tolist() == [i % 4 for i in range(len(order))]


def test_kv_aware_sends_a_returning_prefix_to_the_replica_that_holds_it(tmp_path) -> None:
    p = tmp_path / "mc.jsonl"
    # two families of prefixes, alternating; the first two sent together, the others far apart
    rows = [{"timestamp": 10_000 * i if i > 1 else 0, "input_length": 4 * 512, "output_length": 2,
             "hash_ids": [1000 * (i % 2) + j for j in range(3)] + [50_000 + i]} for i in range(8)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr = load_mooncake_raw(p)
    kv = run_cluster(tr, prof(ram=40 * 512 * 1000), LoadSpec(mode="trace"), 4, "kv-aware")
    rr = run_cluster(tr, prof(ram=40 * 512 * 1000), LoadSpec(mode="trace"), 4, "roundrobin")
    fam = np.arange(8) % 2
    assert len(set(kv.route[fam == 0].tolist())) == 1 and len(set(kv.route[fam == 1].tolist())) == 1
    assert kv.route[:2].tolist() == [0, 1]      # ties (nothing held): the fewest in flight, then the lowest index
    assert kv.token_hit_rate > rr.token_hit_rate
    assert kv.tier_hit_rate["gpu"] > 0


def test_a_shared_tier_gives_every_replica_the_clusters_prefixes(tmp_path) -> None:
    tr = load_mooncake_raw(mooncake(tmp_path / "m.jsonl", 200, 8, 1))
    load = LoadSpec(mode="trace")
    one = run_cluster(tr, prof(ram=200 * 512 * 1000), load, 1, "roundrobin")
    local = run_cluster(tr, prof(ram=200 * 512 * 1000), load, 4, "roundrobin")
    shared = run_cluster(tr, prof(ram=200 * 512 * 1000, shared=10**9), load, 4, "roundrobin")
    assert local.token_hit_rate < one.token_hit_rate
    assert shared.token_hit_rate > local.token_hit_rate and shared.tier_hit_rate["shared"] > 0
    assert shared.shared_bytes_read > 0 and local.shared_bytes_read == 0
    assert shared.shared_read_bw == pytest.approx(shared.shared_bytes_read / shared.duration_s)
    assert all(r.shared_bytes_read > 0 for r in shared.per_replica)
    d = shared.to_dict()
    assert "route" not in d and d["shared_read_bw_per_replica"] == pytest.approx(shared.shared_read_bw / 4)
    json.dumps(d)


def test_bad_cluster_arguments_are_one_line_errors(tmp_path) -> None:
    tr = load_mooncake_raw(mooncake(tmp_path / "m.jsonl", 5, 2, 1))
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        run_cluster(tr, prof(), LoadSpec(mode="trace"), 0)
    with pytest.raises(ValueError, match="routing must be one of"):
        run_cluster(tr, prof(), LoadSpec(mode="trace"), 2, "random")


def test_sticky_follows_a_given_assignment_and_rejects_an_incomplete_one(tmp_path) -> None:
    tr = companion(tmp_path, conversations=10)
    assignment = {c: (0 if i < 8 else 1) for i, c in enumerate(tr.conv_ids)}    # a skewed balancer
    c = run_cluster(tr, comp_prof(), LoadSpec(mode="closed", concurrency=4), 2, "sticky", sticky_assignment=assignment)
    conv_of = np.repeat(np.arange(tr.num_conversations), np.diff(tr.conv_offsets))
    served = c.route >= 0
    assert (c.route[served] == np.array([assignment[tr.conv_ids[k]] for k in conv_of[served]])).all()
    with pytest.raises(ValueError, match="no replica for conversation"):
        run_cluster(tr, comp_prof(), LoadSpec(mode="closed", concurrency=4), 2, "sticky",
                    sticky_assignment=dict(list(assignment.items())[:3]))
    with pytest.raises(ValueError, match="not in 0..1"):
        run_cluster(tr, comp_prof(), LoadSpec(mode="closed", concurrency=4), 2, "sticky",
                    sticky_assignment={c: 2 for c in tr.conv_ids})


@pytest.mark.skipif(__import__("shutil").which("haproxy") is None, reason="no haproxy binary (scripts/setup.sh installs it)")
def test_haproxy_assignment_is_sticky_and_uses_every_replica() -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.cluster.haproxy_assignment import haproxy_assignment

    ids = [f"conv-{i}" for i in range(40)]
    first = haproxy_assignment(ids, 2)
    assert set(first) == set(ids) and set(first.values()) == {0, 1}
    assert haproxy_assignment(ids, 2) == first          # the same ids land on the same replicas again
