"""Engine cost model: the duration of one vLLM step, and of k pure-decode steps in closed form.

See ``kvtier.sim.profile`` for the formula. Pure functions of an ``EngineProfile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.sim.profile import EngineProfile


@dataclass(frozen=True)
class StepCost:
    overhead: float
    per_token: float
    per_pair: float
    per_seq: float
    per_ctx: float

    @classmethod
    def of(cls, e: EngineProfile) -> "StepCost":
        return cls(e.step_overhead_s, e.prefill_token_s, e.prefill_attn_s, e.decode_seq_s, e.decode_ctx_s)

    def step(self, prefill_tokens: int, pairs: float, decodes: int, decode_ctx: int) -> float:
        """One step: ``prefill_tokens`` new tokens with ``pairs`` attention pairs, ``decodes``
        sequences decoding one token each over ``decode_ctx`` context tokens in total."""
        return (self.overhead + self.per_token * prefill_tokens + self.per_pair * pairs
                + self.per_seq * decodes + self.per_ctx * decode_ctx)

    @staticmethod
    def pairs(cached: int, new: int) -> float:
        """Attention pairs of ``new`` tokens appended to ``cached`` context (causal)."""
        return new * (cached + (new + 1) / 2.0)

    def decode_run(self, k: int, decodes: int, ctx0: int) -> float:
        """Duration of ``k`` pure-decode steps; the context grows by ``decodes`` per step."""
        a = self.overhead + self.per_seq * decodes + self.per_ctx * ctx0
        return k * a + self.per_ctx * decodes * k * (k - 1) / 2.0

    def decode_steps_until(self, dt: float, decodes: int, ctx0: int) -> int:
        """Smallest k >= 1 whose ``decode_run`` reaches ``dt`` seconds."""
        a = self.overhead + self.per_seq * decodes + self.per_ctx * ctx0
        b = self.per_ctx * decodes / 2.0       # run(k) = (a - b) k + b k^2
        if dt <= 0:
            return 1
        if b <= 0:
            return max(1, math.ceil(dt / a)) if a > 0 else 1 << 60
        lin = a - b
        k = (-lin + math.sqrt(lin * lin + 4 * b * dt)) / (2 * b)
        k = max(1, math.ceil(k - 1e-9))
        while k > 1 and self.decode_run(k - 1, decodes, ctx0) >= dt:
            k -= 1
        return k
