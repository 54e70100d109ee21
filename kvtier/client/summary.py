"""Summaries of a replay: latency percentiles, token hit rate (overall, over time, last half).

``summarize`` is a pure function of the records (plus run metadata); every key is a number,
``None`` (not measurable: no successful request, or the server reports no cached tokens),
or a nested dict/list of such. Latency statistics use successful requests only.

Compute saved: ``computed_tokens_per_request`` is the mean of prompt - cached tokens (the prompt
tokens the engine actually prefilled) over successful requests that report cached tokens.
TTFT spread: every group (turn groups, prompt-length buckets) has p10 and p90 of TTFT and their
difference ``ttft_spread_s`` (the interdecile range: how uneven latency is within the group).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence

import numpy as np

from kvtier.client.stream import RequestRecord

# Prompt-length buckets in tokens: [lo, hi).
PROMPT_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (0, 256), (256, 1024), (1024, 4096), (4096, 16384), (16384, None))


def latency_stats(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    keys = ("mean", "p50", "p90", "p99", "max")
    if not values:
        return {f"{prefix}_{k}_s": None for k in keys}
    a = np.asarray(values, dtype=float)
    return {f"{prefix}_mean_s": float(a.mean()), f"{prefix}_p50_s": float(np.percentile(a, 50)),
            f"{prefix}_p90_s": float(np.percentile(a, 90)), f"{prefix}_p99_s": float(np.percentile(a, 99)),
            f"{prefix}_max_s": float(a.max())}


def token_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """sum(cached_tokens) / sum(prompt_tokens) over successful requests that report both."""
    cached = prompt = 0
    for r in records:
        if r.ok and r.cached_tokens is not None and r.prompt_tokens:
            cached += r.cached_tokens
            prompt += r.prompt_tokens
    return cached / prompt if prompt else None


def bucket_label(lo: int, hi: int | None) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{k(lo)}+" if hi is None else f"{k(lo)}-{k(hi)}"


def computed_tokens_per_request(records: Iterable[RequestRecord]) -> float | None:
    """Mean prompt - cached tokens over successful requests that report both (None: none do)."""
    vals = [r.prompt_tokens - r.cached_tokens for r in records
            if r.ok and r.cached_tokens is not None and r.prompt_tokens is not None]
    return float(np.mean(vals)) if vals else None


def spread_stats(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    """p10, and the p90 - p10 spread, of ``values`` (None when empty)."""
    if not values:
        return {f"{prefix}_p10_s": None, f"{prefix}_spread_s": None}
    p10, p90 = (float(x) for x in np.percentile(np.asarray(values, dtype=float), [10, 90]))
    return {f"{prefix}_p10_s": p10, f"{prefix}_spread_s": p90 - p10}


def _group_stats(rs: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in rs if r.ok]
    ttft = [r.ttft_s for r in ok]
    return {"requests": len(ok), **latency_stats(ttft, "ttft"), **spread_stats(ttft, "ttft"),
            "token_hit_rate": token_hit_rate(ok), "computed_tokens_per_request": computed_tokens_per_request(ok)}


def hit_rate_windows(records: Sequence[RequestRecord], window_s: float) -> list[dict[str, Any]]:
    """Token hit rate and mean TTFT per window of send time (shows cache warm-up)."""
    ok = [r for r in records if r.ok]
    if not ok or window_s <= 0:
        return []
    end = max(r.start_s for r in ok)
    n = int(end // window_s) + 1
    out = []
    for i in range(n):
        t0, t1 = i * window_s, (i + 1) * window_s
        rs = [r for r in ok if t0 <= r.start_s < t1]
        out.append({"t0_s": t0, "t1_s": t1, "requests": len(rs), "token_hit_rate": token_hit_rate(rs),
                    "ttft_mean_s": float(np.mean([r.ttft_s for r in rs])) if rs else None})
    return out


def summarize(records: Sequence[RequestRecord], *, duration_s: float, windows: int = 10,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out: dict[str, Any] = {
        "requests_total": len(records), "requests_ok": len(ok), "requests_failed": len(failed),
        "requests_timed_out": sum(r.timed_out for r in records),
        "errors_by_kind": dict(Counter(r.error_kind for r in failed)),
        "duration_s": duration_s,
        "request_rate_per_s": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": (sum(r.output_tokens or 0 for r in ok) / duration_s) if duration_s > 0 else None,
        "prompt_tokens_total": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens_total": sum(r.cached_tokens or 0 for r in ok),
        "cached_tokens_reported": any(r.cached_tokens is not None for r in ok),
        "output_tokens_total": sum(r.output_tokens or 0 for r in ok),
        "computed_tokens_per_request": computed_tokens_per_request(ok),
    }
    out.update(latency_stats([r.ttft_s for r in ok], "ttft"))
    out.update(spread_stats([r.ttft_s for r in ok], "ttft"))
    out.update(latency_stats([r.e2e_s for r in ok], "e2e"))
    out.update(latency_stats([x for r in ok for x in r.itl_s], "itl"))
    out["token_hit_rate"] = token_hit_rate(ok)
    half = duration_s / 2
    out["token_hit_rate_last_half"] = token_hit_rate(r for r in ok if r.start_s >= half)
    out["first_turn"] = _group_stats([r for r in records if r.turn == 0])
    out["later_turns"] = _group_stats([r for r in records if r.turn > 0])
    buckets = {}
    for lo, hi in PROMPT_BUCKETS:
        rs = [r for r in ok if r.prompt_tokens is not None and r.prompt_tokens >= lo and (hi is None or r.prompt_tokens < hi)]
        if rs:
            buckets[bucket_label(lo, hi)] = _group_stats(rs)
    out["by_prompt_length"] = buckets
    window_s = duration_s / windows if duration_s > 0 and windows > 0 else 0.0
    out["hit_rate_over_time"] = hit_rate_windows(records, window_s)
    if extra:
        out.update(extra)
    return out


def turn_speedups(baseline: dict[str, Any] | None, summary: dict[str, Any] | None) -> dict[str, float | None]:
    """Mean-TTFT ratio baseline / ``summary`` on all turns, on first turns and on the returning turns
    alone (``later_turns``: turn > 0, where a prefix cache can act). None where either side has no
    such request. Pure."""
    def ratio(b: Any, s: Any) -> float | None:
        return b / s if isinstance(b, (int, float)) and isinstance(s, (int, float)) and s > 0 else None

    b, s = baseline or {}, summary or {}
    return {"all_turns": ratio(b.get("ttft_mean_s"), s.get("ttft_mean_s")),
            "first_turns": ratio((b.get("first_turn") or {}).get("ttft_mean_s"), (s.get("first_turn") or {}).get("ttft_mean_s")),
            "returning_turns": ratio((b.get("later_turns") or {}).get("ttft_mean_s"),
                                     (s.get("later_turns") or {}).get("ttft_mean_s"))}


def phase_means(summary: dict[str, Any] | None) -> dict[str, float | None]:
    """Mean seconds a request spent queueing, prefilling and decoding, and its TTFT, by the server's own
    histograms (``summary["server"]["phases"]``, ``kvtier.client.server_metrics.phase_times``); None
    where not exported. ``queue_share_of_ttft``: queue / TTFT. Pure."""
    phases = ((summary or {}).get("server") or {}).get("phases") or {}
    out = {f"{p}_mean_s": (phases.get(p) or {}).get("mean_s") for p in ("queue", "prefill", "decode", "ttft")}
    q, t = out["queue_mean_s"], out["ttft_mean_s"]
    out["queue_share_of_ttft"] = q / t if q is not None and t else None
    return out
