"""The cluster demo's workload and per-replica capacities, read off per-replica miss-ratio curves.

The workload is small (short prompts, short live replies, a few dozen to a hundred-odd requests per
run: on a 2-vCPU machine every configuration x routing mode must fit a few minutes together):

* ``companion``: the single-machine demo's AI-companion chat (``kvtier.demo.companion.generate``
  with a ``CompanionDemoSize``: live history), shrunk; ``companion_sizes`` are the starting points
  (the fewest users tried, the token lengths at scale 1) of ``kvtier.demo.cluster_interleaving``;
* ``longdoc``: long-document QA (``kvtier.workload.longdoc``): many users ask about the same few
  documents, each question its own conversation.

Capacities (per replica, in tokens; bytes follow from the dtype): the closed loop's send order
(``kvtier.demo.regime.send_order``, the calibration's service times) is split between the replicas
as each routing mode would split it (round-robin: request i to replica i mod N; sticky: a stable hash
of the conversation), and the LRU miss-ratio curve of replica 0's share is computed for both
(``kvtier.sim.stackdist``, chunk granularity, prefix rule). The local capacity (kvtier SSD; the RAM
tier a third of it) is the smallest that serves ``STICKY_SHARE`` of the sticky share's own ideal,
kept below ``LOCAL_MAX_SHARE`` of the cluster's working set: one replica's local tiers hold its
sticky share but not the cluster's working set, and at least twice vLLM's own KV space, which is
the smallest the engine accepts (one full-length request and a block; more requests queue); the shared tier holds ``SHARED_WORKING_SETS``
working sets. Predicted hit rates per (configuration, routing) come from the same curves, one per
replica, weighted by the prompt tokens each replica gets (``predict``): vanilla at vLLM's own KV
space, local at the local capacity (the inclusive RAM tier adds nothing beyond the SSD's reach).

The companion workload's interleaving (users, conversations, token lengths) is not fixed: it is
chosen (``kvtier.demo.cluster_interleaving``) so that vLLM's own KV space, at its floor, sits where
the per-replica round-robin curve predicts at most ``VANILLA_TARGET`` (the published regime: plain
vLLM's prefix cache hits a few per cent of the prompt tokens, because a returning turn comes back
after many other conversations' turns), within the time target where the machine allows.

Time (``run_estimates``): each run is the closed loop of ``kvtier.demo.sizing.config_seconds`` at
the share of the ideal hit rate predicted for it (vanilla at its curve point, local at its, the
shared tier and the KV-aware router at the ideal), per replica (its conversations, its share of the
users, vLLM's KV space: requests queue beyond it and a lone request decodes alone), the slowest
replica's makespan; sticky splits by the hash law of ``sticky_replica`` (HAProxy's own ring may split
differently).
Side-effect free.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from kvtier.demo.common import DEMO_CHUNK_TOKENS

STICKY_SHARE = 0.9        # local tiers: this share of the sticky stream's own ideal hit rate ...
LOCAL_MAX_SHARE = 0.6     # ... and never more than this share of the cluster's working set
RAM_SHARE_OF_LOCAL = 1 / 3
SHARED_WORKING_SETS = 4
MIN_LOCAL_CHUNKS = 4
ENGINE_MULTIPLE = 2
VANILLA_TARGET = 0.05     # vLLM's own KV space: the round-robin curve predicts at most this on every replica ...
VANILLA_BOUND = 0.08      # ... and never more than this (the published regime's bound)
RUN_SLACK = 1.1           # a run vs its slowest replica's closed loop (client and balancer share the host)
RUN_OVERHEAD_S = 8.0      # per run: balancer start, snapshots, settling
DEFAULT_STARTUP_S = 45.0  # a replica's start-up before the calibration measured one
WORKLOADS = ("companion", "longdoc")


@dataclass(frozen=True)
class LongDocSize:
    """The long-document QA workload of the cluster demo (``kvtier.workload.longdoc.LongDocSpec``)."""

    documents: int
    doc_tokens: int
    questions: int
    interleave: int
    max_tokens: int
    concurrency: int
    max_prompt_tokens: int
    think_time_scale: float = 0.0
    seed: int = 11


def companion_sizes() -> dict[str, Any]:
    """The companion sizes (default, quick): the single-machine demo's generator, shrunk."""
    from kvtier.demo.companion import CompanionDemoSize

    base = dict(max_tokens=4, think_time_scale=0.05, engine_kv_fraction=0.2, ram_fraction=0.2,
                user_tokens=24, assistant_tokens=12, resume_fraction=0.0, think_time_s=5.0, away_time_s=10.0)
    default = CompanionDemoSize(conversations=14, turns_mean=3.5, turns_max=7, system_tokens=420,
                                max_prompt_tokens=900, concurrency=8, target_s=900, seed=7,
                                **{**base, "personas": 14})
    quick = CompanionDemoSize(conversations=8, turns_mean=3.0, turns_max=6, system_tokens=360,
                              max_prompt_tokens=800, concurrency=6, target_s=360, seed=7,
                              **{**base, "personas": 8})
    return {"default": default, "quick": quick}


LONGDOC = {"default": LongDocSize(documents=6, doc_tokens=640, questions=6, interleave=6, max_tokens=4,
                                  concurrency=6, max_prompt_tokens=1000),
           "quick": LongDocSize(documents=4, doc_tokens=560, questions=4, interleave=4, max_tokens=4,
                                concurrency=4, max_prompt_tokens=900)}


@dataclass(frozen=True)
class Capacities:
    """Per-replica capacities in tokens, and bytes at ``kv_bytes_per_token``."""

    kv_cache_tokens: int
    ram_tokens: int
    ssd_tokens: int
    shared_tokens: int
    working_set_tokens: int
    kv_bytes_per_token: int

    def bytes(self, tokens: int) -> int:
        return int(tokens) * self.kv_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {"kv_cache_tokens": self.kv_cache_tokens, "ram_bytes": self.bytes(self.ram_tokens),
                "ssd_bytes": self.bytes(self.ssd_tokens), "shared_bytes": self.bytes(self.shared_tokens),
                "ram_tokens": self.ram_tokens, "ssd_tokens": self.ssd_tokens, "shared_tokens": self.shared_tokens,
                "working_set_tokens": self.working_set_tokens, "kv_bytes_per_token": self.kv_bytes_per_token}


@dataclass(frozen=True)
class ClusterPlan:
    """The workload, its capacities, predictions and the time estimate."""

    workload: str
    header: Any
    conversations: list
    facts: Any                           # kvtier.demo.sizing.WorkloadFacts
    concurrency: int
    think_time_scale: float
    max_model_len: int
    history: str
    capacities: Capacities
    predicted: dict[str, float]          # "<config>/<routing>" (vanilla, local) and "ideal"
    run_s: float                         # the longest routing run, estimated
    size: dict[str, Any]
    #: per "<config>/<routing>", that run's estimated seconds (``run_estimates``)
    run_estimates: dict[str, float] = dataclasses.field(default_factory=dict)
    #: per "<config>/<routing>" (vanilla, local), each replica's predicted token hit rate
    predicted_per_replica: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    #: how the interleaving was chosen (``kvtier.demo.cluster_interleaving.Interleaving.to_dict``)
    sizing: dict[str, Any] = dataclasses.field(default_factory=dict)

    def estimate_s(self, runs: Sequence[tuple[str, str]], startup_s: float, calibration_s: float) -> float:
        """Calibration + one start-up of all replicas per configuration (in parallel) + the runs."""
        configs = {c for c, _ in runs}
        return (calibration_s + len(configs) * startup_s * 1.3
                + sum(self.run_estimates.get(f"{c}/{r}", self.run_s) + RUN_OVERHEAD_S for c, r in runs))


def workload_facts(header: Any, convs: list, tokenizer: Any) -> Any:
    """``kvtier.demo.sizing.WorkloadFacts`` of any workload (prompts rendered with ``tokenizer``)."""
    from kvtier.demo.regime import workload_trace
    from kvtier.demo.sizing import WorkloadFacts, conversation_facts
    from kvtier.workload.format import Workload
    from kvtier.workload.stats import workload_stats

    workload = Workload(header=header, conversations=convs)
    stats = workload_stats(workload, tokenizer, block_size=DEMO_CHUNK_TOKENS)
    return WorkloadFacts(requests=stats.requests, prompt_tokens=stats.total_prompt_tokens,
                         ideal_hit_tokens=stats.ideal_hit_tokens,
                         think_s=sum(t.think_time_s for c in convs for t in c.turns[1:]),
                         max_prompt_tokens=int(stats.prompt_tokens.max),
                         conversations=conversation_facts(workload, tokenizer, DEMO_CHUNK_TOKENS),
                         trace=workload_trace(workload, tokenizer, DEMO_CHUNK_TOKENS))


def generate_workload(workload: str, quick: bool, tokenizer: Any) -> tuple[Any, list, Any, dict[str, Any]]:
    """(header, conversations, size dataclass, size as a dict) of the cluster workload."""
    key = "quick" if quick else "default"
    if workload == "companion":
        from kvtier.demo.companion import _spec
        from kvtier.workload.companion import generate_companion

        size = companion_sizes()[key]
        header, convs = generate_companion(_spec(size))
        return header, convs, size, asdict(size)
    if workload == "longdoc":
        from kvtier.workload.longdoc import LongDocSpec, generate_longdoc

        size = LONGDOC[key]
        spec = LongDocSpec(documents=size.documents, doc_tokens=size.doc_tokens, spread=0.1,
                           max_prompt_length=size.max_prompt_tokens, questions=size.questions,
                           interleave=size.interleave, max_tokens=size.max_tokens, rate=1.0, seed=size.seed)
        header, convs = generate_longdoc(spec, tokenizer)
        return header, convs, size, asdict(size)
    raise ValueError(f"unknown workload {workload!r} (one of: {', '.join(WORKLOADS)})")


def sticky_replica(conversation_id: str, replicas: int) -> int:
    """The replica a stable hash of the conversation picks (what a hashing balancer does, in law)."""
    return zlib.crc32(conversation_id.encode()) % replicas


def split(order: Sequence[tuple[int, int]], conv_ids: Sequence[str], replicas: int, routing: str) -> list[int]:
    """Replica of each request of ``order`` under ``routing`` (``roundrobin`` or ``sticky``)."""
    if routing == "roundrobin":
        return [i % replicas for i in range(len(order))]
    return [sticky_replica(conv_ids[ci], replicas) for ci, _ in order]


def replica_curve(trace: Any, order: Sequence[tuple[int, int]], mine: Sequence[bool]) -> Any:
    """LRU miss-ratio curve of the requests of ``order`` flagged in ``mine``, in that order."""
    from kvtier.sim.stackdist import AccessStream, access_stream, miss_ratio_curve
    from kvtier.sim.trace import SimTrace

    rank = np.full(trace.num_requests, np.nan)
    for i, (ci, k) in enumerate(order):
        rank[int(trace.conv_offsets[ci]) + k] = float(i)
    missing = np.isnan(rank)
    rank[missing] = len(order) + np.arange(int(missing.sum()))
    ordered = SimTrace(trace.name, trace.unit_tokens, trace.conv_ids, trace.conv_arrival_s, trace.conv_offsets,
                       trace.turn, trace.prompt_tokens, trace.max_tokens, trace.think_s, rank, trace.hashes,
                       trace.hoffsets)
    stream = access_stream(ordered, DEMO_CHUNK_TOKENS)
    keep_req = np.zeros(trace.num_requests, dtype=bool)
    for (ci, k), m in zip(order, mine):
        if m:
            keep_req[int(trace.conv_offsets[ci]) + k] = True
    mask = keep_req[stream.req]
    sub = AccessStream(stream.keys[mask], stream.req[mask], stream.tokens[mask],
                       int(trace.prompt_tokens[keep_req].sum()), stream.chunk_tokens)
    return miss_ratio_curve(sub, DEMO_CHUNK_TOKENS)


def choose_local_chunks(sticky: Any, working_set_chunks: int, engine_chunks: int) -> int:
    """The smallest capacity serving ``STICKY_SHARE`` of the sticky curve's ideal and at least
    ``ENGINE_MULTIPLE`` x vLLM's own KV space (else the local tiers add nothing to it), capped by
    ``LOCAL_MAX_SHARE`` of the working set (and at least ``MIN_LOCAL_CHUNKS``)."""
    want = max(sticky.smallest_reaching(STICKY_SHARE) or working_set_chunks, ENGINE_MULTIPLE * engine_chunks)
    cap = max(MIN_LOCAL_CHUNKS, int(working_set_chunks * LOCAL_MAX_SHARE))
    return max(MIN_LOCAL_CHUNKS, min(int(want), cap))


def replica_curves(trace: Any, order: Sequence[tuple[int, int]], conv_ids: Sequence[str],
                   replicas: int) -> dict[str, tuple[list[Any], list[int]]]:
    """Per routing mode, (each replica's curve, the prompt tokens each replica gets)."""
    tokens = [int(trace.prompt_tokens[int(trace.conv_offsets[ci]) + k]) for ci, k in order]
    out: dict[str, tuple[list[Any], list[int]]] = {}
    for routing in ("roundrobin", "sticky"):
        where = split(order, conv_ids, replicas, routing)
        curves, weights = [], []
        for rep in range(replicas):
            mine = [x == rep for x in where]
            curves.append(replica_curve(trace, order, mine))
            weights.append(sum(t for t, m in zip(tokens, mine) if m))
        out[routing] = curves, weights
    return out


def predict(curves: dict[str, tuple[list[Any], list[int]]],
            points: dict[str, int]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(cluster hit rate, per-replica hit rates) per "<name>/<routing>" for each capacity
    ``points[name]`` (chunks), for both routing modes (``replica_curves``): each replica's curve at the
    capacity, weighted by the prompt tokens it gets."""
    cluster: dict[str, float] = {}
    per: dict[str, list[float]] = {}
    for routing, (cs, weights) in curves.items():
        for name, chunks in points.items():
            hits = [float(c.at(chunks)) for c in cs]
            per[f"{name}/{routing}"] = hits
            cluster[f"{name}/{routing}"] = sum(h * w for h, w in zip(hits, weights)) / max(1, sum(weights))
    return cluster, per


def replica_facts(facts: Any, conv_ids: Sequence[str], replicas: int, routing: str) -> list[tuple[Any, float]]:
    """Per replica, (the facts of the conversations it serves, its share of the conversations): under
    round-robin every replica serves about 1 / N of every conversation's turns, modelled as conversation
    i on replica i mod N; under sticky each conversation on its ``sticky_replica``."""
    out = []
    for rep in range(replicas):
        mine = [i for i in range(len(facts.conversations))
                if (i % replicas if routing != "sticky" else sticky_replica(conv_ids[i], replicas)) == rep]
        convs = tuple(facts.conversations[i] for i in mine)
        turns = [t for c in convs for t in c]
        sub = dataclasses.replace(facts, requests=len(turns), prompt_tokens=sum(t.prompt_tokens for t in turns),
                                  ideal_hit_tokens=sum(t.ideal_hit_tokens for t in turns),
                                  think_s=sum(t.think_s for c in convs for t in c[1:]), conversations=convs)
        out.append((sub, len(mine) / max(1, len(facts.conversations))))
    return out


def run_estimates(profile: Any, facts: Any, conv_ids: Sequence[str], users: int, think: float, out: int | None,
                  replicas: int, engine_tokens: int, predicted: dict[str, float]) -> dict[str, float]:
    """Estimated seconds of every (configuration, routing) run (module docstring): per replica, the
    closed loop of its conversations with its share of the users and vLLM's KV space (requests queue
    beyond it; a lone request's decode is not batched), the slowest replica's makespan."""
    from kvtier.demo.sizing import config_seconds

    ideal = predicted.get("ideal") or facts.ideal_hit_rate
    split_facts = {r: replica_facts(facts, conv_ids, replicas, r) for r in ("roundrobin", "sticky")}
    cache: dict[tuple[str, float], float] = {}

    def seconds(routing: str, hit: float) -> float:
        share = round(min(1.0, hit / ideal), 3) if ideal > 0 else 0.0
        key = ("sticky" if routing == "sticky" else "roundrobin", share)
        if key not in cache:
            cache[key] = RUN_SLACK * max(
                config_seconds(profile, f, max(1, round(users * w)), think, share, out, kv_tokens=engine_tokens)
                for f, w in split_facts[key[0]] if f.requests)
        return cache[key]

    return {f"{c}/{r}": seconds(r, predicted.get(f"{c}/{r}", ideal))
            for c in ("vanilla", "local", "shared") for r in ("roundrobin", "sticky", "kv-aware")}


def engine_tokens_for(size: Any, history: str) -> tuple[int, int]:
    """(max_model_len, vLLM's KV space in tokens: one full-length request and a block, whole blocks)."""
    from kvtier.demo.sizing import ENGINE_BLOCK_TOKENS

    reply_cap = 5 * getattr(size, "assistant_tokens", 0) if history == "live" else size.max_tokens
    max_len = size.max_prompt_tokens + max(size.max_tokens, reply_cap) + 64
    return max_len, -(-(max_len + ENGINE_BLOCK_TOKENS) // ENGINE_BLOCK_TOKENS) * ENGINE_BLOCK_TOKENS


def plan_for_size(workload: str, size: Any, header: Any, convs: list, replicas: int, tokenizer: Any, profile: Any,
                  kv_bytes_per_token: int, history: str = "live") -> ClusterPlan:
    """The plan of one cluster demo on a given workload and size (module docstring)."""
    from kvtier.demo.regime import send_order

    if workload == "longdoc":
        history = "workload"                  # single-turn conversations: no history to carry
    facts = workload_facts(header, convs, tokenizer)
    users, think = size.concurrency, size.think_time_scale
    out = None if history == "live" else size.max_tokens
    order = send_order(facts, users, profile, think, out_tokens=out)
    conv_ids = [c.id for c in convs]
    ws_chunks = -(-facts.working_set_tokens // DEMO_CHUNK_TOKENS)
    max_len, engine = engine_tokens_for(size, history)
    curves = replica_curves(facts.trace, order, conv_ids, replicas)
    local = choose_local_chunks(curves["sticky"][0][0], ws_chunks, engine // DEMO_CHUNK_TOKENS)
    caps = Capacities(kv_cache_tokens=engine,
                      ram_tokens=max(2, round(local * RAM_SHARE_OF_LOCAL)) * DEMO_CHUNK_TOKENS,
                      ssd_tokens=local * DEMO_CHUNK_TOKENS,
                      shared_tokens=max(SHARED_WORKING_SETS * ws_chunks, 64) * DEMO_CHUNK_TOKENS,
                      working_set_tokens=facts.working_set_tokens, kv_bytes_per_token=kv_bytes_per_token)
    predicted, per = predict(curves, {"vanilla": engine // DEMO_CHUNK_TOKENS, "local": local})
    predicted["ideal"] = facts.ideal_hit_rate
    runs = run_estimates(profile, facts, conv_ids, users, think, out, replicas, engine, predicted)
    return ClusterPlan(workload=workload, header=header, conversations=convs, facts=facts, concurrency=users,
                       think_time_scale=think, max_model_len=max_len, history=history, capacities=caps,
                       predicted=predicted, run_s=max(runs.values()), size=asdict(size), run_estimates=runs,
                       predicted_per_replica=per)


def default_runs(quick: bool) -> list[tuple[str, str]]:
    """The (configuration, routing) runs of the demo's default for the mode."""
    from kvtier.demo.cluster import ClusterOptions

    return ClusterOptions(quick=quick).runs()


def plan_cluster(workload: str, quick: bool, replicas: int, tokenizer: Any, profile: Any,
                 kv_bytes_per_token: int, history: str = "live", *, startup_s: float = DEFAULT_STARTUP_S,
                 calibration_s: float = 0.0, runs: Sequence[tuple[str, str]] | None = None) -> ClusterPlan:
    """The plan of one cluster demo (module docstring). The companion workload's interleaving is
    chosen for ``runs`` (default: the mode's) within the mode's time target
    (``kvtier.demo.cluster_interleaving``); the long-document workload's size is fixed."""
    runs = list(runs) if runs is not None else default_runs(quick)
    if workload == "companion":
        from kvtier.demo.cluster_interleaving import choose_interleaving

        base = companion_sizes()["quick" if quick else "default"]
        return choose_interleaving(base, replicas, tokenizer, profile, kv_bytes_per_token, history, runs=runs,
                                   startup_s=startup_s, calibration_s=calibration_s).plan
    header, convs, size, _ = generate_workload(workload, quick, tokenizer)
    return plan_for_size(workload, size, header, convs, replicas, tokenizer, profile, kv_bytes_per_token, history)


def with_history(plan: ClusterPlan, history: str) -> ClusterPlan:
    return dataclasses.replace(plan, history=history)
