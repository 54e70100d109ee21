"""Greedy-output agreement of ``kvtier bench encoding``: an engine whose prompt prefixes were loaded from
an encoded shared tier against the reference (float32 recompute, vLLM without kvtier). Pure functions.

Input per prompt and engine: the ``n`` greedy tokens it generated and the log-probability of each chosen
token (vLLM's ``logprobs=0``: the sampled token's own). Both engines generate the same ``n`` tokens per
prompt (``ignore_eos``). Definitions:

* **identical**: all ``n`` tokens of the prompt are equal.
* **common prefix** ``L``: the leading positions whose tokens are equal (``L = n`` when identical).
* **prefix agreement**: the mean over prompts of ``L / n`` (tokens identical before the first divergence).
* **position agreement**: the mean over prompts of the share of positions ``i`` with equal tokens (after
  a divergence the contexts differ: this also counts agreement by chance).
* **|Δ logprob|**: ``|lp_ref[i] - lp_test[i]|`` over every position ``i < L`` of every prompt: the same
  token chosen after the same context, the only positions where both numbers are the probability of one
  event. Pooled over all prompts: mean and max; ``first_token``: the mean at ``i = 0`` alone (context =
  the prompt itself, nothing generated yet).

``agreement`` raises ValueError when the two sides do not hold the same prompts or token counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class Generation:
    """One prompt's greedy output: token ids and each chosen token's log-probability."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.logprobs)} log-probabilities")

    @classmethod
    def from_json(cls, d: dict) -> "Generation":
        return cls(tuple(int(t) for t in d["tokens"]), tuple(float(x) for x in d["logprobs"]))


@dataclass(frozen=True)
class Agreement:
    prompts: int
    tokens: int                              # generated tokens per prompt
    identical: int                           # prompts whose tokens are all equal
    identical_share: float
    prefix_share: float                      # mean of L / n
    position_share: float                    # mean share of equal positions
    first_divergence: tuple[int | None, ...]  # per prompt: L, or None when identical
    positions_compared: int                  # positions behind the |Δ logprob| figures
    mean_abs_dlogprob: float | None
    max_abs_dlogprob: float | None
    first_token_abs_dlogprob: float | None   # mean at position 0

    def to_json(self) -> dict:
        return asdict(self)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref: Sequence[Generation], test: Sequence[Generation]) -> Agreement:
    """``test`` against ``ref``, prompt by prompt (see the module doc)."""
    if len(ref) != len(test) or not ref:
        raise ValueError(f"{len(test)} outputs to compare with {len(ref)} reference outputs (need the same, > 0)")
    n = len(ref[0].tokens)
    if n == 0 or any(len(g.tokens) != n for g in (*ref, *test)):
        raise ValueError(f"every output must hold the same number of tokens (> 0), the first holds {n}")
    prefix, position, diverge, deltas, first = [], [], [], [], []
    for r, t in zip(ref, test):
        cut = common_prefix(r.tokens, t.tokens)
        prefix.append(cut / n)
        position.append(sum(x == y for x, y in zip(r.tokens, t.tokens)) / n)
        diverge.append(None if cut == n else cut)
        deltas += [abs(r.logprobs[i] - t.logprobs[i]) for i in range(cut)]
        if cut:
            first.append(abs(r.logprobs[0] - t.logprobs[0]))
    same = sum(d is None for d in diverge)
    return Agreement(prompts=len(ref), tokens=n, identical=same, identical_share=same / len(ref),
                     prefix_share=sum(prefix) / len(prefix), position_share=sum(position) / len(position),
                     first_divergence=tuple(diverge), positions_compared=len(deltas),
                     mean_abs_dlogprob=sum(deltas) / len(deltas) if deltas else None,
                     max_abs_dlogprob=max(deltas) if deltas else None,
                     first_token_abs_dlogprob=sum(first) / len(first) if first else None)
