"""SLO search: the largest load whose latency statistic stays within an SLO.

Load is the number of concurrent users (closed loop) or the conversation arrival rate
(open loop). Search: start at ``start`` and double while points pass, then bisect between
the last passing and the first failing load (to 1 user, or to ``rate_tolerance`` relative
width). A point runs ``repeats`` times; it passes when no request failed in any repeat and
the median of the statistic (default ``ttft_p90_s``) is <= ``slo_s``. The search assumes
latency grows with load (monotone); the curve of every evaluated point is reported.

Each point replays the next slice of the workload (the conversation offset advances), so
points do not re-send the prompts of earlier points unless the workload wraps around.

Steady state (``steady_state``): a closed-loop point of N users starts with a burst of N
simultaneous requests and ends with a drain where fewer than N are in flight. The statistic is
then computed on the steady-state window only: requests after the first N (by start time) that
finished before the last request was issued (when every user still had work); each point runs at
least ``min_requests_per_user`` x N requests, and reports the mean number of requests in flight
over its window (``in_flight``). A failed request anywhere in the point still fails it. Each
point's repeats are reported with their spread (min, max).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.client.stream import RequestRecord
from kvtier.client.replay import ReplayError, ReplayOptions, replay_conversations, write_json
from kvtier.workload.format import Conversation


#: requests per user a steady-state point needs: with 2, users in lockstep (equal documents) send
#: their second requests in one burst right after the first, so no request ends before the last one
#: is issued and the window is empty (an SLO run with 2 rounds measured 0 window requests at 6 and 8
#: users, points that then "failed" without a measurement)
MIN_STEADY_ROUNDS = 3


@dataclass(frozen=True)
class SloOptions:
    slo_s: float = 2.0
    statistic: str = "ttft_p90_s"      # any latency key of the replay summary
    start: float = 1.0
    max_load: float = 256.0
    repeats: int = 1
    requests_per_point: int | None = None   # None: max(16, 4 * ceil(load))
    steady_state: bool = False         # closed loop: statistic on the steady-state window (see module doc)
    min_requests_per_user: int = 0     # at least this x load requests per point
    rate_tolerance: float = 0.1        # open loop: stop bisecting when (hi - lo) / lo <= this

    def validate(self, mode: str) -> None:
        if self.slo_s <= 0 or self.repeats < 1 or self.start <= 0 or self.max_load < self.start:
            raise ReplayError("SLO search needs slo > 0, repeats >= 1 and 0 < start <= max_load")
        if mode == "closed" and (self.start != int(self.start) or self.max_load != int(self.max_load)):
            raise ReplayError("closed-loop SLO search needs whole numbers of users")
        if not self.statistic.endswith("_s"):
            raise ReplayError(f"SLO statistic must be a latency key like ttft_p90_s, got {self.statistic!r}")
        if self.steady_state and mode == "closed" and self.min_requests_per_user < MIN_STEADY_ROUNDS:
            raise ReplayError(f"a steady-state SLO point needs at least {MIN_STEADY_ROUNDS} requests per user "
                              f"(opening burst, measured round, drain), got {self.min_requests_per_user}")


@dataclass
class SloPoint:
    load: float
    values: list[float | None]
    failed_requests: int
    ok_requests: int
    value: float | None
    passed: bool
    spread: tuple[float, float] | None = None     # (min, max) of the repeats' values
    in_flight: float | None = None                # steady state: mean requests in flight in the window


@dataclass
class SloResult:
    mode: str
    slo_s: float
    statistic: str
    best_load: float | None           # None: even the first point failed
    capped: bool                      # True: max_load passed, the real knee is higher
    points: list[SloPoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SloResult":
        return cls(**{**d, "points": [SloPoint(**{**p, "spread": tuple(p["spread"]) if p.get("spread") else None})
                                      for p in d["points"]]})


Evaluate = Callable[[float, int], tuple[dict[str, Any], Sequence[RequestRecord]]]


def _point(load: float, runs: list[dict[str, Any]], opts: SloOptions) -> SloPoint:
    values = [r.get(opts.statistic) for r in runs]
    failed = sum(r.get("requests_failed", 0) for r in runs)
    ok = sum(r.get("requests_ok", 0) for r in runs)
    known = [v for v in values if v is not None]
    value = statistics.median(known) if len(known) == len(values) and known else None
    flights = [r["in_flight_mean"] for r in runs if r.get("in_flight_mean") is not None]
    return SloPoint(load=load, values=values, failed_requests=failed, ok_requests=ok, value=value,
                    passed=failed == 0 and value is not None and value <= opts.slo_s,
                    spread=(min(known), max(known)) if known else None,
                    in_flight=statistics.fmean(flights) if flights else None)


def steady_window(records: Sequence[RequestRecord], users: int) -> tuple[list[RequestRecord], float, float]:
    """(records in the steady-state window, window start, window end) of a closed-loop run.

    Window: from the start of the (users+1)-th request to the start of the last one; a record is in
    it when it started after the first ``users`` (the opening burst) and ended before the last
    request was issued (after that, users run out of work and fewer are in flight)."""
    ordered = sorted(records, key=lambda r: r.start_s)
    if len(ordered) <= users:
        return [], 0.0, 0.0
    t0, t1 = ordered[users].start_s, ordered[-1].start_s
    kept = [r for r in ordered[users:] if r.ok and r.e2e_s is not None and r.start_s + r.e2e_s <= t1]
    return kept, t0, t1


def mean_in_flight(records: Sequence[RequestRecord], t0: float, t1: float) -> float | None:
    """Time-weighted mean number of requests in flight over [t0, t1] (a failed one until its end or t1)."""
    if t1 <= t0:
        return None
    busy = 0.0
    for r in records:
        end = r.start_s + (r.e2e_s if r.e2e_s is not None else t1 - r.start_s)
        busy += max(0.0, min(end, t1) - max(r.start_s, t0))
    return busy / (t1 - t0)


def steady_summary(full: dict[str, Any], records: Sequence[RequestRecord], users: int) -> dict[str, Any]:
    """The run's summary recomputed on its steady-state window (failures counted over the whole run)."""
    from kvtier.client.summary import summarize

    kept, t0, t1 = steady_window(records, users)
    out = summarize(kept, duration_s=max(t1 - t0, 0.0), windows=0)
    out.update({"requests_failed": full.get("requests_failed", 0), "requests_ok_run": full.get("requests_ok"),
                "window_requests": len(kept), "window_s": max(t1 - t0, 0.0),
                "in_flight_mean": mean_in_flight(records, t0, t1), "steady_state": True,
                "conversations_started": full.get("conversations_started")})
    if not kept:   # too few requests for a window: no statistic, the point cannot pass
        out.update({k: None for k in out if k.endswith("_s") and k not in ("window_s",)})
    return out


def search(evaluate: Evaluate, mode: str, opts: SloOptions,
           on_point: Callable[[SloPoint], None] = lambda p: None) -> SloResult:
    """Run the doubling + bisection search with ``evaluate(load, repeat) -> (summary, records)``."""
    opts.validate(mode)
    integer = mode == "closed"
    points: dict[float, SloPoint] = {}

    def measure(load: float) -> SloPoint:
        load = float(int(load)) if integer else load
        if load not in points:
            points[load] = _point(load, [evaluate(load, i)[0] for i in range(opts.repeats)], opts)
            on_point(points[load])
        return points[load]

    lo: float | None = None
    hi: float | None = None
    x = opts.start
    while True:
        if measure(x).passed:
            lo = x
            if x >= opts.max_load:
                break
            x = min(x * 2, opts.max_load)
        else:
            hi = x
            break
    if lo is not None and hi is not None:
        while True:
            if integer:
                if hi - lo <= 1:
                    break
                mid = float((int(lo) + int(hi)) // 2)
            else:
                if (hi - lo) / lo <= opts.rate_tolerance:
                    break
                mid = (lo + hi) / 2
            if measure(mid).passed:
                lo = mid
            else:
                hi = mid
    return SloResult(mode=mode, slo_s=opts.slo_s, statistic=opts.statistic, best_load=lo,
                     capped=lo is not None and hi is None,
                     points=sorted(points.values(), key=lambda p: p.load))


def replay_evaluator(convs: Sequence[Conversation], url: str, base: ReplayOptions, slo: SloOptions,
                     out_dir: Path | None = None) -> Evaluate:
    """An evaluator that replays successive slices of ``convs`` at each load."""
    state = {"offset": base.conversation_offset}

    def evaluate(load: float, repeat: int) -> tuple[dict[str, Any], Sequence[RequestRecord]]:
        n = max(slo.requests_per_point or max(16, 4 * math.ceil(load)), slo.min_requests_per_user * math.ceil(load))
        if base.mode == "closed":
            opts = replace(base, concurrency=int(load), max_requests=n, conversation_offset=state["offset"],
                           progress=False)
        else:
            opts = replace(base, mode="open", rate=load, max_requests=n, conversation_offset=state["offset"],
                           progress=False)
        result = asyncio.run(replay_conversations(convs, url, opts))
        state["offset"] += result.summary["conversations_started"]
        summary = result.summary
        if slo.steady_state and base.mode == "closed":
            summary = steady_summary(result.summary, result.records, int(load))
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            stem = f"load-{load:g}-r{repeat}"
            (out_dir / f"{stem}.jsonl").write_text("".join(r.to_json() + "\n" for r in result.records))
            write_json(out_dir / f"{stem}.summary.json", summary)
        return summary, result.records

    return evaluate


def run_slo(convs: Sequence[Conversation], url: str, base: ReplayOptions, opts: SloOptions,
            out_dir: str | Path | None = None,
            on_point: Callable[[SloPoint], None] = lambda p: None) -> SloResult:
    """SLO search against a running server; writes per-point records and ``slo.json`` to ``out_dir``."""
    if base.mode == "trace":
        raise ReplayError("SLO search needs --mode closed (users) or --mode open (rate)")
    out = Path(out_dir) if out_dir is not None else None
    evaluate = replay_evaluator(convs, url, base, opts, out / "points" if out else None)
    result = search(evaluate, base.mode, opts, on_point)
    if out is not None:
        write_json(out / "slo.json", result.to_dict())
    return result
