"""When each request of a trace is sent: the load's semantics (``kvtier.sim.load``) as a
small state machine shared by one engine (``EngineSim``) and a cluster (``kvtier.sim.cluster``).

``start()`` issues the first requests (closed: ``concurrency`` conversations at t = 0; open /
trace: every conversation's first turn at its start); ``after_request(r, t)`` is called when
request ``r`` finished or failed at ``t`` and issues the conversation's next turn after its
think time (closed loop: the next conversation when this one ended). An issued request goes
into ``heap`` as ``(send time, seq, request index)`` (``seq`` = issue order, unique, so the
heap order is total). ``max_requests`` and ``duration_s`` stop issuing; in trace mode a turn
is never sent before its own ``arrival_s * time_scale``.

``Feed``: what an engine whose own load is off (``EngineSim(..., feed=)``) reports to the one who
sends it requests (a cluster).
"""

from __future__ import annotations

import heapq
from typing import Protocol

import numpy as np

from kvtier.sim.load import LoadSpec, conversation_starts
from kvtier.sim.trace import SimTrace

INF = float("inf")


class Feed(Protocol):
    """Who sends an engine its requests instead of its own load (a cluster's router)."""

    def done(self, r: int, t: float) -> None:
        """Request ``r`` finished (or failed) at ``t``."""

    def next_send_s(self) -> float:
        """The earliest request not yet handed to any engine (inf: none)."""


class LoadIssuer:
    """Issues requests of ``trace`` under ``load`` into ``heap`` (a list kept as a heap)."""

    def __init__(self, trace: SimTrace, load: LoadSpec, heap: list[tuple[float, int, int]]) -> None:
        self.trace, self.load, self.heap = trace, load, heap
        self.seq = 0
        self.issued = 0
        self._next_conv = 0
        self._hint = trace.arrival_hint_s.tolist()
        self._think = trace.think_s.tolist()
        self._coff = trace.conv_offsets.tolist()
        self._conv_of = np.repeat(np.arange(trace.num_conversations), np.diff(trace.conv_offsets)).tolist()
        self._trace_mode = load.mode == "trace"
        self._limit_t = load.duration_s if load.duration_s is not None else float("inf")
        self._limit_n = load.max_requests if load.max_requests is not None else trace.num_requests

    def issue(self, r: int, t: float) -> None:
        """Send request ``r`` at ``t`` (later in trace mode when its arrival says so), unless
        the request budget or the duration is spent."""
        if self.issued >= self._limit_n or t > self._limit_t:
            return
        hint = self._hint[r]
        if self._trace_mode and hint == hint:                 # (NaN: no hint)
            t = max(t, hint * self.load.time_scale)
            if t > self._limit_t:
                return
        self.issued += 1
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, r))

    def start_next_conversation(self, t: float) -> None:
        coff = self._coff
        while self._next_conv < self.trace.num_conversations:
            c = self._next_conv
            self._next_conv += 1
            if coff[c + 1] > coff[c]:
                self.issue(coff[c], t)
                return

    def start(self) -> None:
        """The first requests of the load."""
        ld, coff = self.load, self._coff
        if ld.mode == "closed":
            for _ in range(ld.concurrency):
                self.start_next_conversation(0.0)
        else:
            for t0, c in conversation_starts(ld, self.trace.conv_arrival_s.tolist()):
                if coff[c + 1] > coff[c]:
                    self.issue(coff[c], t0)

    def after_request(self, r: int, t: float) -> None:
        """Request ``r`` finished (or failed) at ``t``: the conversation's next turn, or (closed
        loop, last turn) the next conversation."""
        c = self._conv_of[r]
        if r + 1 < self._coff[c + 1]:
            self.issue(r + 1, t + self._think[r + 1] * self.load.think_time_scale)
        elif self.load.mode == "closed":
            self.start_next_conversation(t)
