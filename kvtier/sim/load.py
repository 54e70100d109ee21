"""How requests reach the simulated server: the same load modes as ``kvtier bench run``.

- closed: ``concurrency`` users; each takes the next conversation (file order) when its last
  one ended; a conversation's first turn is sent at once, later turns ``think_time_s *
  think_time_scale`` after the previous one finished.
- open: conversations arrive as a Poisson process of ``rate`` per second, drawn with
  ``random.Random(seed).expovariate`` exactly like the replay.
- trace: conversation i starts at ``arrival_s * time_scale``; a turn with its own
  ``arrival_s`` is not sent before ``arrival_s * time_scale``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Mode = Literal["closed", "open", "trace"]


class LoadError(ValueError):
    """Bad load options (one line)."""


@dataclass(frozen=True)
class LoadSpec:
    mode: Mode = "closed"
    concurrency: int = 4
    rate: float | None = None
    think_time_scale: float = 1.0
    time_scale: float = 1.0
    seed: int = 0
    max_requests: int | None = None
    duration_s: float | None = None
    max_tokens: int | None = None      # clip every request's output tokens

    def validate(self) -> None:
        if self.mode not in ("closed", "open", "trace"):
            raise LoadError(f"unknown mode {self.mode!r} (closed, open or trace)")
        if self.mode == "closed" and self.concurrency < 1:
            raise LoadError("closed loop needs --max-concurrency >= 1")
        if self.mode == "open" and not (self.rate and self.rate > 0):
            raise LoadError("open loop needs --request-rate > 0 (conversations per second)")
        if self.think_time_scale < 0 or self.time_scale < 0:
            raise LoadError("think-time-scale and time-scale must be >= 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise LoadError("max-requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise LoadError("duration must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise LoadError("max-tokens must be >= 1")


def conversation_starts(spec: LoadSpec, conv_arrival_s: list[float]) -> list[tuple[float, int]]:
    """(start time, conversation index) for open and trace modes, in start order."""
    if spec.mode == "trace":
        return sorted(((a * spec.time_scale, i) for i, a in enumerate(conv_arrival_s)), key=lambda x: x[0])
    rng = random.Random(spec.seed)
    out, t = [], 0.0
    for i in range(len(conv_arrival_s)):
        out.append((t, i))
        t += rng.expovariate(spec.rate)
    return out
