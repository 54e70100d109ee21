"""The worker's timing of each step's forward pass, for the scheduler's prefill-cost estimate.

Contract:
- ``bound`` starts the clock when vLLM binds a step's metadata, only for a step of at least
  ``MIN_FORWARD_TOKENS`` tokens on a CPU engine (on a GPU the host returns before the kernels ran);
  ``load_done`` restarts it after a synchronous load (the forward pass starts then).
- ``done`` stops it at the first call after the forward pass (``start_load_kv`` of the next step,
  or ``wait_for_save``); later calls until the next ``bound`` change nothing.
- ``take`` returns the last timed pass once, as (tokens, attention span, seconds), else None.

Pure bookkeeping on ``time.perf_counter``; no vLLM, no torch.
"""

from __future__ import annotations

import time

#: a forward pass of fewer tokens says little about prefill cost (fixed per-step costs dominate)
MIN_FORWARD_TOKENS = 64


class ForwardTimer:
    def __init__(self) -> None:
        # this step's forward pass: [tokens, span, start, end] (perf_counter seconds)
        self._fwd: list | None = None
        self._forward: tuple[int, int, float] | None = None

    def bound(self, tokens: int, span: int, on_cpu: bool) -> None:
        """A step of ``tokens`` tokens (``span``: their attention work) was bound: its pass starts now."""
        self._fwd = [tokens, span, time.perf_counter(), None] \
            if on_cpu and tokens >= MIN_FORWARD_TOKENS else None

    def load_done(self) -> None:
        """A synchronous load ended: the forward pass starts after it."""
        if self._fwd is not None:
            self._fwd[2] = time.perf_counter()

    def done(self) -> None:
        """The forward pass of the bound step has ended (first call only)."""
        f = self._fwd
        if f is not None and f[3] is None:
            f[3] = time.perf_counter()
            self._forward = (int(f[0]), int(f[1]), f[3] - f[2])
            self._fwd = None

    def take(self) -> tuple[int, int, float] | None:
        """The last timed pass (tokens, span, seconds), once."""
        forward, self._forward = self._forward, None
        return forward
