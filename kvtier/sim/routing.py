"""Routing policies of a simulated cluster: which replica serves a request, decided when it is sent.

- ``roundrobin``: the i-th request sent goes to replica ``i mod N`` (HAProxy ``balance
  roundrobin`` with equal weights, per HTTP request).
- ``sticky``: a hash of the conversation id picks the replica (HAProxy ``balance hdr(...)``
  with its default map-based ``sdbm`` hash, equal weights: ``sdbm(id) mod N``), so every turn
  of a conversation lands on the same replica.
- ``kv-aware``: the replica whose own caches — vLLM's prefix cache and its private kvtier
  tiers (RAM, SSD) — hold the longest prefix of the request's chunks; ties go to the replica
  with the fewest requests in flight, then the lowest index. A shared tier is the same for
  every replica and decides nothing, so it is not scored (a router learning the replicas' KV
  events sees shared chunks as stored by the replica that wrote them, which also holds them
  locally until it evicts them).

``make_router`` raises ``ValueError`` (one line) for an unknown name. Routers read the
engines' state and change nothing in it.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import numpy as np

from kvtier.sim.scheduler import EngineSim
from kvtier.sim.trace import SimTrace

ROUTINGS = ("roundrobin", "sticky", "kv-aware")


class Router(Protocol):
    def pick(self, r: int, inflight: list[int]) -> int:
        """The replica for request ``r`` (``inflight``: requests sent to each replica and not
        finished)."""


def sdbm(data: bytes) -> int:
    """HAProxy's default hash (``hash_sdbm``), 32-bit unsigned."""
    h = 0
    for c in data:
        h = (c + (h << 6) + (h << 16) - h) & 0xFFFFFFFF
    return h


class RoundRobin:
    def __init__(self, replicas: int) -> None:
        self.n = replicas
        self.i = -1

    def pick(self, r: int, inflight: list[int]) -> int:
        self.i += 1
        return self.i % self.n


class Sticky:
    """Every turn of a conversation on one replica: ``sdbm(id) mod N``, or ``assignment`` (conversation
    id -> replica, e.g. the one a real balancer chose: ``benchmarks/cluster/haproxy_assignment.py``)."""

    def __init__(self, replicas: int, trace: SimTrace, assignment: Mapping[str, int] | None = None) -> None:
        conv_of = np.repeat(np.arange(trace.num_conversations), np.diff(trace.conv_offsets))
        if assignment is not None:
            missing = [c for c in trace.conv_ids if c not in assignment]
            if missing:
                raise ValueError(f"sticky assignment has no replica for conversation {missing[0]!r}")
            bad = [c for c in trace.conv_ids if not 0 <= assignment[c] < replicas]
            if bad:
                raise ValueError(f"sticky assignment puts {bad[0]!r} on replica {assignment[bad[0]]}, "
                                 f"not in 0..{replicas - 1}")
            per_conv = [int(assignment[c]) for c in trace.conv_ids]
        else:
            per_conv = [sdbm(c.encode()) % replicas for c in trace.conv_ids]
        self.of_request = [per_conv[c] for c in conv_of.tolist()]

    def pick(self, r: int, inflight: list[int]) -> int:
        return self.of_request[r]


class KvAware:
    def __init__(self, engines: Sequence[EngineSim], trace: SimTrace) -> None:
        self.engines = list(engines)
        self.trace = trace
        self._hoff = trace.hoffsets.tolist()
        self._cu = engines[0].chunk_units
        # private tiers only (a shared tier is attached to every replica's store)
        self._has = [[t.policy.contains for t in e.store.tiers if t.name != "shared"] if e.store else []
                     for e in self.engines]
        self._first = [e.cache.match_free for e in self.engines]

    def held(self, i: int, units: list[int]) -> int:
        """Leading units of ``units`` replica ``i`` holds (prefix cache or a private tier)."""
        e = self.engines[i]
        g = e.cache.match(units)
        has = self._has[i]
        if not has:
            return g
        cu = self._cu
        keys = units if cu == 1 else units[cu - 1::cu]
        n = 0
        for k in keys:
            for h in has:
                if h(k):
                    break
            else:
                break
            n += 1
        return max(g, n * cu)

    def pick(self, r: int, inflight: list[int]) -> int:
        units = self.trace.hashes[self._hoff[r]:self._hoff[r + 1]].tolist()
        best, choice = (0, -inflight[0]), 0
        if units:
            # a replica holding not even the first unit (nor its first chunk) scores 0: one dict look-up
            # each, the full prefix only for the others
            k0 = units[min(self._cu, len(units)) - 1]
            for i, (first, has) in enumerate(zip(self._first, self._has)):
                s = 0
                if first(units, 1)[0]:
                    s = self.held(i, units)
                else:
                    for h in has:
                        if h(k0):
                            s = self.held(i, units)
                            break
                key = (s, -inflight[i])
                if key > best:
                    best, choice = key, i
        else:
            for i in range(1, len(self.engines)):
                if -inflight[i] > best[1]:
                    best, choice = (0, -inflight[i]), i
        return choice


def make_router(name: str, engines: Sequence[EngineSim], trace: SimTrace,
                sticky_assignment: Mapping[str, int] | None = None) -> Router:
    if name == "roundrobin":
        return RoundRobin(len(engines))
    if name == "sticky":
        return Sticky(len(engines), trace, sticky_assignment)
    if name == "kv-aware":
        return KvAware(engines, trace)
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {name!r}")
