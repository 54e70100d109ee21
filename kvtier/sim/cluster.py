"""A cluster: N replicas (each a vLLM engine with private kvtier RAM / SSD tiers) behind one
load balancer, fed by ONE load, optionally sharing one shared tier.

``run_cluster(trace, profile, load, replicas, routing)``:

* the load (closed / open / trace, ``kvtier.sim.issue.LoadIssuer``: the replay's semantics) is
  the cluster's: a conversation's next turn is sent its think time after the previous turn
  finished, on whichever replica served it; closed loop: ``concurrency`` users for the whole
  cluster;
* each request is routed when it is sent (``kvtier.sim.routing``: roundrobin, sticky,
  kv-aware) to one replica — an ``EngineSim`` over the whole trace fed by the cluster
  (``EngineSim.admit`` / ``Feed``) — and stays there (preemptions included);
* every replica gets ``profile`` (engine, RAM, SSD); ``profile.shared`` is the cluster's
  shared tier: ONE ``TierModel`` (global capacity and eviction; its read bandwidth is each
  reader's, the model has no contention) in every replica's store;
* events run in global time order: sends first at equal times, then replicas by index; a
  replica's step takes effect at the step's end (a chunk saved by one replica is in the
  shared tier from the end of the step that computed it).

With one replica every routing gives exactly the single engine's results. Side-effect free.
The partitioned projection (conversations split up front, a load per machine) stays as
``simulate_cluster`` (``kvtier.sim.partitioned``).
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import numpy as np

from kvtier.sim.issue import INF, LoadIssuer
from kvtier.sim.load import LoadSpec
from kvtier.sim.nogc import gc_paused
from kvtier.sim.partitioned import PartitionedResult, simulate_cluster
from kvtier.sim.profile import SimProfile
from kvtier.sim.result import SimResult
from kvtier.sim.routing import ROUTINGS, make_router
from kvtier.sim.scheduler import EngineSim
from kvtier.sim.tiers import TIER_NAMES, TierModel
from kvtier.sim.trace import SimTrace

__all__ = ["ClusterResult", "ReplicaStats", "run_cluster", "simulate_cluster", "PartitionedResult", "ROUTINGS"]
TIER_KEYS = ("gpu", *TIER_NAMES)


@dataclass(frozen=True)
class ReplicaStats:
    requests: int                   # served (finished) requests
    token_hit_rate: float | None
    ttft_mean_s: float | None
    shared_bytes_read: int


@dataclass(frozen=True)
class ClusterResult:
    replicas: int
    routing: str
    shared: bool
    requests: int                   # served (finished) requests
    sent: int
    failed: int
    token_hit_rate: float | None
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    computed_tokens_per_request: float | None
    tier_hit_rate: dict[str, float | None]      # share of prompt tokens per tier (gpu = vLLM's prefix cache)
    per_replica: list[ReplicaStats]
    shared_bytes_read: int
    shared_read_bw: float           # bytes/s: shared_bytes_read over the run's duration
    duration_s: float
    route: np.ndarray               # replica of each request (-1: never sent)
    result: SimResult               # the replicas' per-request arrays, merged

    def to_dict(self) -> dict[str, Any]:
        """Everything but the per-request arrays, JSON-ready."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("route", "result")}
        d["tier_hit_rate"] = dict(self.tier_hit_rate)
        d["per_replica"] = [asdict(p) for p in self.per_replica]
        d["shared_read_bw_per_replica"] = self.shared_read_bw / self.replicas
        return d


class _Cluster:
    """The cluster's load, router and event loop (the replicas' ``Feed``)."""

    def __init__(self, trace: SimTrace, profile: SimProfile, load: LoadSpec, replicas: int, routing: str,
                 sticky_assignment: Mapping[str, int] | None = None) -> None:
        self.trace, self.load = trace, load
        self.engines = [EngineSim(trace, profile, load, feed=self) for _ in range(replicas)]
        self.shared = self._attach_shared(profile)
        self.router = make_router(routing, self.engines, trace, sticky_assignment)
        self.sends: list[tuple[float, int, int]] = []
        self.issuer = LoadIssuer(trace, load, self.sends)
        self.inflight = [0] * replicas
        self.route = [-1] * trace.num_requests

    def _attach_shared(self, profile: SimProfile) -> TierModel | None:
        """Replace every replica's own shared tier by one global ``TierModel``."""
        e0 = self.engines[0]
        if e0.store is None or not e0.store.tiers or e0.store.tiers[-1].name != "shared":
            return None
        chunk_tokens = e0.chunk_units * e0.U
        shared = TierModel.open("shared", profile.shared, chunk_tokens * profile.kv_bytes_per_token, chunk_tokens,
                                profile.eviction)
        for e in self.engines:
            e.store.tiers[-1] = shared
        return shared

    def done(self, r: int, t: float) -> None:
        self.inflight[self.route[r]] -= 1
        self.issuer.after_request(r, t)

    def next_send_s(self) -> float:
        return self.sends[0][0] if self.sends else INF

    def run(self) -> None:
        engines, sends, route, inflight = self.engines, self.sends, self.route, self.inflight
        pick = self.router.pick
        n = len(engines)
        gens = [e.steps() for e in engines]
        ver = [0] * n
        due = [INF] * n
        heap: list[tuple[float, int, int]] = []       # (time, replica, version)

        def wake(i: int, t: float) -> None:
            ver[i] += 1
            due[i] = t
            if t < INF:
                heapq.heappush(heap, (t, i, ver[i]))

        for i, g in enumerate(gens):
            wake(i, next(g))
        self.issuer.start()
        pop = heapq.heappop
        while True:
            while heap and heap[0][2] != ver[heap[0][1]]:
                pop(heap)
            te = heap[0][0] if heap else INF
            ts = sends[0][0] if sends else INF
            if ts == INF and te == INF:
                break
            if ts <= te:
                t, seq, r = pop(sends)
                i = pick(r, inflight)
                route[r] = i
                inflight[i] += 1
                e = engines[i]
                e.admit(r, t, seq)
                if e.truncatable and t < due[i]:
                    wake(i, t)
            else:
                _, i, _ = pop(heap)
                wake(i, next(gens[i]))
        for g in gens:                       # every replica idle: resumed without a request, it ends
            for _ in g:
                raise RuntimeError("a replica had work left at the end of the cluster run")

    def result(self, routing: str) -> ClusterResult:
        tr, engines = self.trace, self.engines
        n = tr.num_requests
        route = np.array(self.route, dtype=np.int64)
        res = [e.result for e in engines]
        merged = _merge(res, route, n)
        ok = merged.ok
        prompt = tr.prompt_tokens
        shared_i = [(e.store.tiers.index(self.shared) if self.shared is not None else -1) for e in engines]
        chunk_bytes = self.shared.chunk_bytes if self.shared is not None else 0
        sh_bytes = [(e.chunks_read[shared_i[k]] * chunk_bytes if shared_i[k] >= 0 and e.chunks_read else 0)
                    for k, e in enumerate(engines)]
        per = []
        for k in range(len(engines)):
            m = ok & (route == k)
            per.append(ReplicaStats(int(m.sum()), _rate(merged.cached_tokens[m], prompt[m]),
                                    float(merged.ttft_s[m].mean()) if m.any() else None, int(sh_bytes[k])))
        ttft = merged.ttft_s[ok]
        tot = int(prompt[ok].sum())
        duration = max((r.duration_s for r in res), default=0.0)
        total_sh = int(sum(sh_bytes))
        return ClusterResult(
            replicas=len(engines), routing=routing, shared=self.shared is not None, requests=int(ok.sum()),
            sent=int(merged.sent.sum()), failed=int((merged.sent & ~ok).sum()),
            token_hit_rate=_rate(merged.cached_tokens[ok], prompt[ok]),
            ttft_mean_s=float(ttft.mean()) if len(ttft) else None,
            ttft_p50_s=float(np.percentile(ttft, 50)) if len(ttft) else None,
            ttft_p90_s=float(np.percentile(ttft, 90)) if len(ttft) else None,
            computed_tokens_per_request=float((prompt[ok] - merged.cached_tokens[ok]).mean()) if len(ttft) else None,
            tier_hit_rate={k: (int(merged.tier_tokens[k][ok].sum()) / tot if tot else None) for k in TIER_KEYS},
            per_replica=per, shared_bytes_read=total_sh, shared_read_bw=total_sh / duration if duration > 0 else 0.0,
            duration_s=duration, route=route, result=merged)


def _rate(cached: np.ndarray, prompt: np.ndarray) -> float | None:
    tot = int(prompt.sum())
    return int(cached.sum()) / tot if tot else None


def _merge(res: list[SimResult], route: np.ndarray, n: int) -> SimResult:
    """Per request, the arrays of the replica that served it."""
    def pick(field: str, fill: Any, dtype: Any) -> np.ndarray:
        out = np.full(n, fill, dtype=dtype)
        for k, r in enumerate(res):
            m = route == k
            out[m] = getattr(r, field)[m]
        return out

    tiers = {}
    for key in TIER_KEYS:
        out = np.zeros(n, dtype=np.int64)
        for k, r in enumerate(res):
            m = route == k
            out[m] = r.tier_tokens[key][m]
        tiers[key] = out
    counters: dict[str, int] = {}
    for r in res:
        for key, v in r.counters.items():
            if not key.endswith("_capacity_chunks"):
                counters[key] = counters.get(key, 0) + v
    nan = float("nan")
    return SimResult(sent=pick("sent", False, bool), ok=pick("ok", False, bool), send_s=pick("send_s", nan, np.float64),
                     ttft_s=pick("ttft_s", nan, np.float64), e2e_s=pick("e2e_s", nan, np.float64),
                     cached_tokens=pick("cached_tokens", 0, np.int64), tier_tokens=tiers,
                     load_s=pick("load_s", 0.0, np.float64), output_tokens=res[0].output_tokens,
                     duration_s=max(r.duration_s for r in res), steps=sum(r.steps for r in res), counters=counters)


def run_cluster(trace: SimTrace, profile: SimProfile, load: LoadSpec, replicas: int,
                routing: str = "roundrobin", sticky_assignment: Mapping[str, int] | None = None) -> ClusterResult:
    """Simulate ``replicas`` engines behind ``routing`` under one ``load`` (module docstring);
    ``sticky_assignment`` (conversation id -> replica) replaces sticky's own hash."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    load.validate()
    c = _Cluster(trace, profile, load, replicas, routing, sticky_assignment)
    with gc_paused():
        c.run()
    return c.result(routing)
