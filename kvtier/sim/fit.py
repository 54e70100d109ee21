"""Fit the engine's step-cost model to measured TTFTs and inter-token gaps (numpy least squares).

Single-request TTFT with chunked prefill of ``n`` new tokens after ``c`` cached ones, token
budget ``B`` per step::

    ttft = request_overhead + steps * step_overhead + prefill_token * n + prefill_attn * pairs(c, n)

with ``steps = ceil(n / B)`` and ``pairs`` the causal attention pairs (``StepCost.pairs``).
A decode step with ``D`` sequences: ``step_overhead + decode_seq * D``. Coefficients are
constrained to be >= 0 (a negative one is fixed at 0 and the rest refitted). Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.sim.costs import StepCost


@dataclass(frozen=True)
class PrefillSample:
    new_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    sequences: int
    step_s: float


@dataclass(frozen=True)
class Fit:
    step_overhead_s: float
    prefill_token_s: float
    prefill_attn_s: float
    decode_seq_s: float
    request_overhead_s: float
    prefill_rel_error: float     # mean |pred - meas| / meas over the prefill samples


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping negative coefficients (small problems only)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def fit_engine(prefill: list[PrefillSample], decode: list[DecodeSample], budget: int) -> Fit:
    if not prefill:
        raise ValueError("no prefill samples to fit")
    # decode: step = overhead + decode_seq * D  (needs two distinct D for the slope)
    if decode:
        d = np.array([[1.0, s.sequences] for s in decode])
        y = np.array([s.step_s for s in decode])
        ov, seq = _nnls(d, y) if len({s.sequences for s in decode}) > 1 else (np.array([y.mean(), 0.0]))
    else:
        ov, seq = 0.0, 0.0
    rows, ys = [], []
    for s in prefill:
        steps = max(1, math.ceil(s.new_tokens / budget))
        rows.append([1.0, s.new_tokens, StepCost.pairs(s.cached_tokens, s.new_tokens)])
        ys.append(s.ttft_s - steps * ov)
    a, b = np.array(rows), np.array(ys)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1
    req, tok, attn = _nnls(a / scale, b) / scale
    pred = a @ np.array([req, tok, attn]) + np.array([max(1, math.ceil(s.new_tokens / budget)) * ov for s in prefill])
    meas = np.array([s.ttft_s for s in prefill])
    err = float(np.mean(np.abs(pred - meas) / np.maximum(meas, 1e-9)))
    return Fit(float(ov), float(tok), float(attn), float(seq), float(req), err)
