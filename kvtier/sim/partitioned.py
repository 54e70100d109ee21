"""Several serving machines, each with its own vLLM engine, private kvtier tiers and its own
copy of the load, sharing one shared tier: the partitioned projection (``simulate_cluster``,
kept for the results made with it; ``kvtier.sim.cluster.run_cluster`` is the cluster behind
one load and a router).

Conversations are split round-robin (conversation c on machine c mod N), and every machine
replays its share under its own load (closed loop: ``concurrency`` users each). Every machine is
an ``EngineSim`` over its share of the trace; the shared tier is ONE ``TierModel`` appended to
every machine's store (its capacity, bandwidth and eviction are global). The machines advance
in clock order, one scheduling round at a time (``EngineSim.steps``), so a chunk one machine
saves is visible to the others from its next round on. Side-effect free.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvtier.sim.load import LoadSpec
from kvtier.sim.nogc import gc_paused
from kvtier.sim.profile import SimProfile
from kvtier.sim.scheduler import EngineSim
from kvtier.sim.tiers import TierModel
from kvtier.sim.trace import SimTrace


@dataclass(frozen=True)
class PartitionedResult:
    machines: int
    shared: bool
    requests: int
    token_hit_rate: float
    ttft_mean_s: float
    ttft_p90_s: float
    tier_hit_rate: dict[str, float]


def simulate_cluster(trace: SimTrace, profile: SimProfile, load: LoadSpec, machines: int,
                     shared_bytes: int) -> PartitionedResult:
    if machines < 1:
        raise ValueError("machines must be >= 1")
    local = profile.model_copy(deep=True)
    local.shared.capacity = 0
    engines = []
    for m in range(machines):
        part = trace.subset(np.arange(m, trace.num_conversations, machines))
        engines.append(EngineSim(part, local, load))
    shared = None
    if shared_bytes > 0:
        e0 = engines[0]
        chunk_tokens = e0.chunk_units * e0.U
        speed = profile.shared.model_copy(update={"capacity": shared_bytes})
        shared = TierModel.open("shared", speed, chunk_tokens * profile.kv_bytes_per_token, chunk_tokens,
                                profile.eviction)
        for e in engines:
            if e.store is None:
                raise ValueError("a shared tier needs kvtier on (profile.save)")
            e.store.tiers.append(shared)
    gens = [e.steps() for e in engines]
    heap = [(0.0, i) for i in range(machines)]
    with gc_paused():
        while heap:
            _, i = heapq.heappop(heap)
            try:
                heapq.heappush(heap, (next(gens[i]), i))
            except StopIteration:
                pass
    ok = np.concatenate([e.result.ok for e in engines])
    prompt = np.concatenate([e.trace.prompt_tokens for e in engines])[ok]
    ttft = np.concatenate([e.result.ttft_s for e in engines])[ok]
    cached = np.concatenate([e.result.cached_tokens for e in engines])[ok]
    tiers = {k: float(np.concatenate([e.result.tier_tokens[k] for e in engines])[ok].sum() / max(prompt.sum(), 1))
             for k in ("gpu", "ram", "ssd", "shared")}
    return PartitionedResult(machines, shared is not None, int(ok.sum()), float(cached.sum() / max(prompt.sum(), 1)),
                         float(ttft.mean()) if len(ttft) else float("nan"),
                         float(np.percentile(ttft, 90)) if len(ttft) else float("nan"), tiers)
