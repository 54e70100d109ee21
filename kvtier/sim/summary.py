"""The simulator's summary: the same keys as ``kvtier bench run`` (``kvtier.client.summary``),
computed with numpy from per-request arrays, plus the hit rate per tier over time.

A test holds ``summarize_sim`` to ``kvtier.client.summary.summarize`` on the same records.
Pure functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.client.stream import RequestRecord
from kvtier.client.summary import PROMPT_BUCKETS, bucket_label
from kvtier.sim.result import SimResult
from kvtier.sim.trace import SimTrace

TIER_KEYS = ("gpu", "ram", "ssd", "shared")


def _lat(a: np.ndarray, prefix: str) -> dict[str, float | None]:
    keys = ("mean", "p50", "p90", "p99", "max")
    if a.size == 0:
        return {f"{prefix}_{k}_s": None for k in keys}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {f"{prefix}_mean_s": float(a.mean()), f"{prefix}_p50_s": float(p50), f"{prefix}_p90_s": float(p90),
            f"{prefix}_p99_s": float(p99), f"{prefix}_max_s": float(a.max())}


def _lat_weighted(v: np.ndarray, w: np.ndarray, prefix: str) -> dict[str, float | None]:
    """``_lat(np.repeat(v, w))`` without materialising the repeat (1M requests x hundreds of
    output tokens would be GBs): numpy's linear-interpolation percentiles on the implied array."""
    keep = w > 0
    v, w = v[keep], w[keep].astype(np.int64)
    if v.size == 0:
        return _lat(v, prefix)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cw = np.cumsum(w)
    n = int(cw[-1])

    def at(i: np.ndarray) -> np.ndarray:          # element i (0-based) of the sorted repeat
        return v[np.searchsorted(cw, i, side="right")]
    h = (n - 1) * np.array([50.0, 90.0, 99.0]) / 100.0
    lo = np.floor(h).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    a, b = at(lo), at(hi)
    p50, p90, p99 = a + (h - lo) * (b - a)
    return {f"{prefix}_mean_s": float((v * w).sum() / n), f"{prefix}_p50_s": float(p50),
            f"{prefix}_p90_s": float(p90), f"{prefix}_p99_s": float(p99), f"{prefix}_max_s": float(v[-1])}


def _rate(cached: np.ndarray, prompt: np.ndarray) -> float | None:
    total = int(prompt.sum())
    return int(cached.sum()) / total if total else None


def _spread(a: np.ndarray, prefix: str) -> dict[str, float | None]:
    """p10 and the p90 - p10 spread (``kvtier.client.summary.spread_stats``)."""
    if a.size == 0:
        return {f"{prefix}_p10_s": None, f"{prefix}_spread_s": None}
    p10, p90 = np.percentile(a, [10, 90])
    return {f"{prefix}_p10_s": float(p10), f"{prefix}_spread_s": float(p90 - p10)}


def _computed(cached: np.ndarray, prompt: np.ndarray) -> float | None:
    """Mean prompt - cached tokens (``kvtier.client.summary.computed_tokens_per_request``)."""
    return float((prompt - cached).mean()) if prompt.size else None


def _group(m: np.ndarray, ok: np.ndarray, ttft, cached, prompt) -> dict[str, Any]:
    g = m & ok
    return {"requests": int(g.sum()), **_lat(ttft[g], "ttft"), **_spread(ttft[g], "ttft"),
            "token_hit_rate": _rate(cached[g], prompt[g]), "computed_tokens_per_request": _computed(cached[g], prompt[g])}


def summarize_sim(trace: SimTrace, res: SimResult, *, windows: int = 10,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    sent, ok = res.sent, res.ok
    prompt = trace.prompt_tokens
    cached = res.cached_tokens
    ttft = res.ttft_s
    d = res.duration_s
    failed = sent & ~ok
    out: dict[str, Any] = {
        "requests_total": int(sent.sum()), "requests_ok": int(ok.sum()), "requests_failed": int(failed.sum()),
        "requests_timed_out": 0,
        "errors_by_kind": ({"kv_cache_too_small": int(failed.sum())} if failed.any() else {}),
        "duration_s": d,
        "request_rate_per_s": int(ok.sum()) / d if d > 0 else None,
        "output_tokens_per_s": float(res.output_tokens[ok].sum()) / d if d > 0 else None,
        "prompt_tokens_total": int(prompt[ok].sum()),
        "cached_tokens_total": int(cached[ok].sum()),
        "cached_tokens_reported": bool(ok.any()),
        "output_tokens_total": int(res.output_tokens[ok].sum()),
        "computed_tokens_per_request": _computed(cached[ok], prompt[ok]),
    }
    out.update(_lat(ttft[ok], "ttft"))
    out.update(_spread(ttft[ok], "ttft"))
    out.update(_lat(res.e2e_s[ok], "e2e"))
    m = ok & (res.output_tokens > 1)
    gaps = (res.e2e_s[m] - ttft[m]) / (res.output_tokens[m] - 1)     # a request's mean inter-token gap
    out.update(_lat_weighted(gaps, res.output_tokens[m] - 1, "itl"))
    out["token_hit_rate"] = _rate(cached[ok], prompt[ok])
    start = res.send_s
    late = ok & (start >= d / 2)
    out["token_hit_rate_last_half"] = _rate(cached[late], prompt[late])
    out["first_turn"] = _group(sent & (trace.turn == 0), ok, ttft, cached, prompt)
    out["later_turns"] = _group(sent & (trace.turn > 0), ok, ttft, cached, prompt)
    buckets = {}
    for lo, hi in PROMPT_BUCKETS:
        m = ok & (prompt >= lo) & (prompt < (hi if hi is not None else np.iinfo(np.int64).max))
        if m.any():
            buckets[bucket_label(lo, hi)] = _group(m, ok, ttft, cached, prompt)
    out["by_prompt_length"] = buckets
    out["hit_rate_over_time"] = _windows(res, prompt, ok, windows, d)
    if extra:
        out.update(extra)
    return out


def _windows(res: SimResult, prompt: np.ndarray, ok: np.ndarray, windows: int, d: float) -> list[dict[str, Any]]:
    """Per window of send time: token hit rate, mean TTFT and the hit rate served by each tier."""
    window_s = d / windows if d > 0 and windows > 0 else 0.0
    if not ok.any() or window_s <= 0:
        return []
    start = res.send_s
    end = float(start[ok].max())
    n = int(end // window_s) + 1
    idx = np.where(ok, np.floor(np.nan_to_num(start, nan=0.0) / window_s), -1).astype(np.int64)
    out = []
    for i in range(n):
        m = idx == i
        tot = int(prompt[m].sum())
        row: dict[str, Any] = {"t0_s": i * window_s, "t1_s": (i + 1) * window_s, "requests": int(m.sum()),
                               "token_hit_rate": int(res.cached_tokens[m].sum()) / tot if tot else None,
                               "ttft_mean_s": float(res.ttft_s[m].mean()) if m.any() else None}
        row["tier_hit_rate"] = {k: (int(res.tier_tokens[k][m].sum()) / tot if tot else None) for k in TIER_KEYS}
        out.append(row)
    return out


def tier_hit_rates(trace: SimTrace, res: SimResult) -> dict[str, float | None]:
    """Share of all prompt tokens served by each tier (gpu = vLLM's own prefix cache)."""
    ok = res.ok
    tot = int(trace.prompt_tokens[ok].sum())
    return {k: (int(res.tier_tokens[k][ok].sum()) / tot if tot else None) for k in TIER_KEYS}


def to_records(trace: SimTrace, res: SimResult, limit: int | None = None) -> list[RequestRecord]:
    """RequestRecords for the report's plots (optionally an even sample of ``limit``)."""
    idx = np.flatnonzero(res.sent)
    if limit is not None and len(idx) > limit:
        idx = idx[np.linspace(0, len(idx) - 1, limit).astype(np.int64)]
    conv_of = np.repeat(np.arange(trace.num_conversations), np.diff(trace.conv_offsets))
    out = []
    for r in idx.tolist():
        okr = bool(res.ok[r])
        out.append(RequestRecord(
            conversation_id=trace.conv_ids[conv_of[r]], turn=int(trace.turn[r]), api="sim",
            start_s=float(res.send_s[r]), ttft_s=float(res.ttft_s[r]) if okr else None,
            e2e_s=float(res.e2e_s[r]) if okr else None, prompt_tokens=int(trace.prompt_tokens[r]),
            cached_tokens=int(res.cached_tokens[r]), output_tokens=int(res.output_tokens[r]) if okr else None,
            max_tokens=int(res.output_tokens[r]), error_kind=None if okr else "kv_cache_too_small"))
    return out
