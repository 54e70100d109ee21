"""The closed loop the companion demo's estimate models: makespan and per-request TTFT.

``users`` users take the conversations in order, each the next one when its last ended; a
conversation is a list of turns ``(work s, think s before the turn[, tokens generated[, KV tokens
held]])``. A turn is sent its think time after the previous turn ended.

* **Admission** (``kv_tokens``): vLLM runs a request only while its blocks fit in the engine's KV
  space; the others wait in its queue, first come first served. A turn holds its KV tokens (the
  companion estimate passes its prompt: vLLM allocates a reply's blocks as it generates them) from
  admission to its end; a request is admitted when what the running ones hold plus its own fits in
  ``kv_tokens`` (or when nothing runs). ``None``: no limit (every sent request runs).
  With the demo's small engine KV space (a couple of requests) this is what makes a saturated
  engine queue, and why its decode is hardly batched.
* **Prefill**: the running requests that are still prefilling share the engine equally (processor
  sharing) for their prefill work.
* **Decode**: a request that has finished its prefill decodes its tokens, one per decode step of the
  ``m`` requests decoding together: with ``n`` running it gets ``m / n`` of the engine, so it
  advances ``m / (n x decode_step(m))`` tokens a second. Tokens need ``decode_step``; without one
  they are ignored.

``LoopRun`` keeps the makespan and, per request, its queueing time (send -> admission) and TTFT
(send -> end of prefill). Side-effect free apart from ``on_send``.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

Turn = tuple[float, ...]


@dataclass(frozen=True)
class LoopRun:
    """One modelled closed-loop run: makespan, and per (conversation, turn) its queue wait and TTFT."""

    makespan_s: float
    ttft_s: dict[tuple[int, int], float] = field(default_factory=dict)
    queue_s: dict[tuple[int, int], float] = field(default_factory=dict)

    def mean_ttft(self, returning_only: bool = False) -> float | None:
        vals = [t for (ci, k), t in self.ttft_s.items() if not returning_only or k > 0]
        return sum(vals) / len(vals) if vals else None

    def mean_queue(self) -> float | None:
        return sum(self.queue_s.values()) / len(self.queue_s) if self.queue_s else None


@dataclass
class _Req:
    user: int
    conv: int
    turn: int
    sent: float
    work: float
    tokens: float
    held: float


def closed_loop_run(conversations: Sequence[Sequence[Turn]], users: int,
                    decode_step: Callable[[float], float] | None = None,
                    on_send: Callable[[float, int, int], None] | None = None,
                    kv_tokens: float | None = None) -> LoopRun:
    """The modelled run (module docstring). ``on_send(time, conversation, turn)`` is told of every
    request as it is sent (the send order the miss-ratio curve is computed on, ``kvtier.demo.regime``)."""
    queue = iter(range(len(conversations)))
    now = 0.0
    waiting: list[tuple[float, int, int, int]] = []     # (send time, user, conversation, turn): thinking
    queued: deque[_Req] = deque()                       # sent, not admitted (KV space full)
    running: list[_Req] = []
    ttft: dict[tuple[int, int], float] = {}
    qwait: dict[tuple[int, int], float] = {}

    def next_conversation(user: int) -> None:
        for ci in queue:
            if conversations[ci]:
                heapq.heappush(waiting, (now + conversations[ci][0][1], user, ci, 0))
                return

    def send_or_next(user: int, ci: int, k: int) -> None:
        if k < len(conversations[ci]):
            heapq.heappush(waiting, (now + conversations[ci][k][1], user, ci, k))
        else:
            next_conversation(user)

    def admit() -> None:
        held = sum(r.held for r in running)
        while queued and (not running or kv_tokens is None or held + queued[0].held <= kv_tokens):
            r = queued.popleft()
            qwait[(r.conv, r.turn)] = now - r.sent
            if r.work <= 0:
                ttft[(r.conv, r.turn)] = now - r.sent
            running.append(r)
            held += r.held

    for u in range(max(1, users)):
        next_conversation(u)
    while waiting or running or queued:
        n = len(running)
        m = sum(1 for r in running if r.work <= 0)
        step = decode_step(m) if m and decode_step is not None else 0.0
        dec_rate = m / (n * step) if step > 0 else float("inf")      # tokens a second for each decoding request
        t_done = min((now + (r.work * n if r.work > 0 else r.tokens / dec_rate) for r in running),
                     default=float("inf"))
        t_send = waiting[0][0] if waiting else float("inf")
        t = min(t_done, t_send)
        dt = t - now
        for r in running:
            if r.work > 0:
                r.work -= dt / n
                # at large clock values a tiny remainder no longer moves the clock (t + w n == t): done
                if r.work <= 1e-12 or t + r.work * n <= t:
                    r.work = 0.0
                    ttft[(r.conv, r.turn)] = t - r.sent
            elif step > 0:
                r.tokens -= dt * dec_rate
                if r.tokens > 0 and t + r.tokens / dec_rate <= t:
                    r.tokens = 0.0
            else:
                r.tokens = 0.0
        now = t
        done = [r for r in running if r.work <= 0 and r.tokens <= 1e-9]
        for r in done:
            running.remove(r)
            send_or_next(r.user, r.conv, r.turn + 1)
        while waiting and waiting[0][0] <= now:
            _, u, ci, k = heapq.heappop(waiting)
            if on_send is not None:
                on_send(now, ci, k)
            turn = conversations[ci][k]
            tokens = float(turn[2]) if len(turn) > 2 and decode_step is not None else 0.0
            held = float(turn[3]) if len(turn) > 3 else 0.0
            queued.append(_Req(u, ci, k, now, max(0.0, turn[0]), tokens, held))
        admit()
        if not running and not queued and not waiting:
            break
    return LoopRun(now, ttft, qwait)
