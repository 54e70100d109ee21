"""Capacity planning: what each RAM / SSD / shared size buys, and the cheapest configuration
meeting a hit-rate or TTFT target.

1. One pass over the trace gives the miss-ratio curve of one LRU tier (``stackdist``):
   token hit rate vs capacity, and the ideal (infinite) hit rate. kvtier's tiers are
   write-through, so with RAM <= SSD the tiers together hit like one tier of the larger size,
   RAM serving the accesses under its own size.
2. The knee: the smallest capacity reaching ``target`` x ideal.
3. Candidates (RAM, SSD, shared sizes from a grid around the knee) are priced with per-GiB
   costs; each is simulated end to end (``run.simulate``) for TTFT, cheapest first, until
   one meets the targets. Side-effect free (the caller writes outputs).

A cluster (``make_cluster_plan``, ``kvtier plan --replicas N``): every replica writes through
to the one shared tier, so the shared tier sees the whole cluster's accesses and needs what the
curve of the whole trace says; the knee is the first candidate, then 1.5x, 2x, 4x of it, each
simulated as the cluster (``kvtier.sim.cluster.run_cluster``, the profile's RAM / SSD per
replica) until the cluster's hit rate reaches ``target`` x ideal. Reported with it: the read
bandwidth the shared tier must sustain, mean over the run and the busiest window's, in total
and per replica, and the same cluster without a shared tier.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import SimProfile
from kvtier.sim.run import simulate
from kvtier.sim.stackdist import MissRatioCurve, access_stream, miss_ratio_curve
from kvtier.sim.trace import SimTrace

GIB = 2**30


@dataclass(frozen=True)
class Prices:
    """Relative cost per GiB of each tier (only ratios matter; defaults in docs/simulator.md)."""
    ram: float = 4.0
    ssd: float = 0.1
    shared: float = 0.05


@dataclass
class Candidate:
    ram_bytes: int
    ssd_bytes: int
    shared_bytes: int
    cost: float
    predicted_hit_rate: float            # from the curve
    ttft_mean_s: float | None = None     # from the simulation
    ttft_p90_s: float | None = None
    token_hit_rate: float | None = None
    meets: bool | None = None


@dataclass
class Plan:
    chunk_bytes: int
    sample_rate: float
    ideal_hit_rate: float
    target_fraction: float
    knee_bytes: int | None
    knee_hit_rate: float | None
    curve: list[dict[str, float]]
    baseline: dict[str, Any]
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def auto_sample_rate(accesses: int, budget: int = 2_000_000) -> float:
    return 1.0 if accesses <= budget else max(1e-4, budget / accesses)


def _sizes(knee_chunks: int, chunk_bytes: int) -> list[int]:
    base = max(1, knee_chunks) * chunk_bytes
    return sorted({int(base * f) for f in (0.125, 0.25, 0.5, 1.0, 1.5, 2.0)})


def _curve_at(trace: SimTrace, profile: SimProfile, target: float, sample_rate: float | None):
    """(chunk bytes, sampling rate, the trace's miss-ratio curve, its knee at ``target`` of the ideal)."""
    chunk_tokens = max(1, profile.chunk_size // trace.unit_tokens) * trace.unit_tokens
    chunk_bytes = chunk_tokens * profile.kv_bytes_per_token
    stream = access_stream(trace, profile.chunk_size)
    rate = sample_rate if sample_rate is not None else auto_sample_rate(len(stream.keys))
    mrc = miss_ratio_curve(stream, chunk_bytes, rate)
    return chunk_bytes, rate, mrc, mrc.smallest_reaching(target)


def make_plan(trace: SimTrace, profile: SimProfile, load: LoadSpec, *, target: float = 0.9,
              target_ttft_s: float | None = None, prices: Prices = Prices(), sample_rate: float | None = None,
              with_shared: bool = False, max_sims: int = 24) -> Plan:
    chunk_bytes, rate, mrc, knee = _curve_at(trace, profile, target, sample_rate)
    curve = [{"capacity_bytes": float(c * chunk_bytes), "token_hit_rate": float(h)}
             for c, h in zip(mrc.capacities_chunks, mrc.hit_rate)]
    vanilla = profile.model_copy(update={"save": False})
    base = simulate(trace, vanilla, load).summary
    plan = Plan(chunk_bytes, rate, mrc.ideal_hit_rate, target, None if knee is None else knee * chunk_bytes,
                None if knee is None else mrc.at(knee), curve,
                {"ttft_mean_s": base["ttft_mean_s"], "ttft_p90_s": base["ttft_p90_s"],
                 "token_hit_rate": base["token_hit_rate"]})
    if knee is None:
        return plan
    sizes = _sizes(knee, chunk_bytes)
    ram_sizes = [s for s in sizes if s <= knee * chunk_bytes] + [0]
    cands = []
    for r in sorted(set(ram_sizes)):
        for s in sizes + [0]:
            if s and s < r:
                continue
            if r == 0 and s == 0:
                continue
            cap = max(r, s)
            cost = r / GIB * prices.ram + s / GIB * (prices.shared if with_shared else prices.ssd)
            c = Candidate(r, 0 if with_shared else s, s if with_shared else 0, cost, mrc.at(cap / chunk_bytes))
            cands.append(c)
    cands.sort(key=lambda c: (c.cost, -c.predicted_hit_rate))
    want_hit = target * mrc.ideal_hit_rate
    sims = 0
    for c in cands:
        if c.predicted_hit_rate < want_hit - 0.02 and target_ttft_s is None:
            continue                     # the curve already rules it out
        if sims >= max_sims:
            break
        p = profile.model_copy(deep=True)
        p.ram.capacity, p.ssd.capacity, p.shared.capacity = c.ram_bytes, c.ssd_bytes, c.shared_bytes
        s = simulate(trace, p, load).summary
        sims += 1
        c.ttft_mean_s, c.ttft_p90_s, c.token_hit_rate = s["ttft_mean_s"], s["ttft_p90_s"], s["token_hit_rate"]
        ok_hit = (c.token_hit_rate or 0) >= want_hit - 1e-9 if target_ttft_s is None else True
        ok_ttft = target_ttft_s is None or (c.ttft_mean_s is not None and c.ttft_mean_s <= target_ttft_s)
        c.meets = bool(ok_hit and ok_ttft)
        plan.candidates.append(c)
        if c.meets:
            plan.best = c
            break
    return plan


@dataclass
class ClusterCandidate:
    shared_bytes: int
    predicted_hit_rate: float            # from the curve
    token_hit_rate: float | None
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    shared_read_bw: float                # bytes/s, mean over the run, whole cluster
    shared_read_bw_peak: float           # bytes/s, busiest window (``BW_WINDOWS`` per run)
    meets: bool


@dataclass
class ClusterPlan:
    replicas: int
    routing: str
    chunk_bytes: int
    ideal_hit_rate: float
    target_fraction: float
    knee_bytes: int | None
    local_only: dict[str, Any]
    candidates: list[ClusterCandidate] = field(default_factory=list)
    best: ClusterCandidate | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for c in d["candidates"] + ([d["best"]] if d["best"] else []):
            c["shared_read_bw_per_replica"] = c["shared_read_bw"] / self.replicas
            c["shared_read_bw_peak_per_replica"] = c["shared_read_bw_peak"] / self.replicas
        return d


BW_WINDOWS = 100          # the run cut in this many windows (at least 1 s each) for the busiest one


def peak_shared_bw(res, kv_bytes_per_token: int, duration_s: float) -> float:
    """Bytes/s of shared-tier reads in the busiest window: each request's shared-tier tokens
    counted at its first token (the load ends before it)."""
    ok = res.ok
    if not ok.any() or duration_s <= 0:
        return 0.0
    w = max(1.0, duration_s / BW_WINDOWS)
    t = (res.send_s[ok] + res.ttft_s[ok]) // w
    b = res.tier_tokens["shared"][ok] * kv_bytes_per_token
    _, inv = np.unique(t, return_inverse=True)
    return float(np.bincount(inv, weights=b).max() / w)


def make_cluster_plan(trace: SimTrace, profile: SimProfile, load: LoadSpec, *, replicas: int,
                      routing: str = "roundrobin", target: float = 0.9,
                      sample_rate: float | None = None) -> ClusterPlan:
    from kvtier.sim.cluster import run_cluster
    chunk_bytes, rate, mrc, knee = _curve_at(trace, profile, target, sample_rate)
    local = profile.model_copy(deep=True)
    local.shared.capacity = 0
    lo = run_cluster(trace, local, load, replicas, routing)
    plan = ClusterPlan(replicas, routing, chunk_bytes, mrc.ideal_hit_rate, target,
                       None if knee is None else knee * chunk_bytes,
                       {"token_hit_rate": lo.token_hit_rate, "ttft_mean_s": lo.ttft_mean_s,
                        "ttft_p90_s": lo.ttft_p90_s})
    if knee is None:
        return plan
    want = target * mrc.ideal_hit_rate
    for f in (1.0, 1.5, 2.0, 4.0):
        cap = int(max(1, knee) * chunk_bytes * f)
        p = profile.model_copy(deep=True)
        p.shared.capacity = cap
        r = run_cluster(trace, p, load, replicas, routing)
        c = ClusterCandidate(cap, mrc.at(cap / chunk_bytes), r.token_hit_rate, r.ttft_mean_s, r.ttft_p90_s,
                             r.shared_read_bw, peak_shared_bw(r.result, profile.kv_bytes_per_token, r.duration_s),
                             (r.token_hit_rate or 0.0) >= want - 1e-9)
        plan.candidates.append(c)
        if c.meets:
            plan.best = c
            break
    return plan


def plot_curve(plan: Plan, path, gpu_cache_bytes: int | None = None):
    from kvtier.bench.report import _finish, _plt
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.array([p["capacity_bytes"] for p in plan.curve]) / GIB
    y = np.array([p["token_hit_rate"] for p in plan.curve])
    ax.plot(x, y, label=f"one LRU tier (sample rate {plan.sample_rate:g})")
    ax.axhline(plan.ideal_hit_rate, ls=":", color="gray", label=f"ideal {plan.ideal_hit_rate:.1%}")
    ax.axhline(plan.target_fraction * plan.ideal_hit_rate, ls="--", color="tab:red",
               label=f"{plan.target_fraction:.0%} of ideal")
    if plan.knee_bytes:
        ax.axvline(plan.knee_bytes / GIB, ls="--", color="tab:green", label=f"knee {plan.knee_bytes / GIB:.3g} GiB")
    if gpu_cache_bytes:
        ax.axvline(gpu_cache_bytes / GIB, ls="-.", color="tab:purple", label="vLLM KV cache")
    ax.set_xscale("log")
    return _finish(plt, fig, ax, path, xlabel="capacity (GiB)", ylabel="token hit rate",
                   title="hit rate vs cache capacity", minor_grid=True)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    if n == 0:
        return "0"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = min(len(units) - 1, int(math.log(max(n, 1), 1024)))
    return f"{n / 1024 ** i:.3g} {units[i]}"
