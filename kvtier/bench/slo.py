"""SLO search: the largest load whose latency statistic stays within an SLO.

Load is the number of concurrent users (closed loop) or the conversation arrival rate
(open loop). Search: start at ``start`` and double while points pass, then bisect between
the last passing and the first failing load (to 1 user, or to ``rate_tolerance`` relative
width). A point runs ``repeats`` times; it passes when no request failed in any repeat and
the median of the statistic (default ``ttft_p90_s``) is <= ``slo_s``. The search assumes
latency grows with load (monotone); the curve of every evaluated point is reported.

Each point replays the next slice of the workload (the conversation offset advances), so
points do not re-send the prompts of earlier points unless the workload wraps around.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.bench.client import RequestRecord
from kvtier.bench.replay import ReplayError, ReplayOptions, replay_conversations, write_json
from kvtier.workload.format import Conversation


@dataclass(frozen=True)
class SloOptions:
    slo_s: float = 2.0
    statistic: str = "ttft_p90_s"      # any latency key of the replay summary
    start: float = 1.0
    max_load: float = 256.0
    repeats: int = 1
    requests_per_point: int | None = None   # None: max(16, 4 * ceil(load))
    rate_tolerance: float = 0.1        # open loop: stop bisecting when (hi - lo) / lo <= this

    def validate(self, mode: str) -> None:
        if self.slo_s <= 0 or self.repeats < 1 or self.start <= 0 or self.max_load < self.start:
            raise ReplayError("SLO search needs slo > 0, repeats >= 1 and 0 < start <= max_load")
        if mode == "closed" and (self.start != int(self.start) or self.max_load != int(self.max_load)):
            raise ReplayError("closed-loop SLO search needs whole numbers of users")
        if not self.statistic.endswith("_s"):
            raise ReplayError(f"SLO statistic must be a latency key like ttft_p90_s, got {self.statistic!r}")


@dataclass
class SloPoint:
    load: float
    values: list[float | None]
    failed_requests: int
    ok_requests: int
    value: float | None
    passed: bool


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
        return cls(**{**d, "points": [SloPoint(**p) for p in d["points"]]})


Evaluate = Callable[[float, int], tuple[dict[str, Any], Sequence[RequestRecord]]]


def _point(load: float, runs: list[dict[str, Any]], opts: SloOptions) -> SloPoint:
    values = [r.get(opts.statistic) for r in runs]
    failed = sum(r.get("requests_failed", 0) for r in runs)
    ok = sum(r.get("requests_ok", 0) for r in runs)
    known = [v for v in values if v is not None]
    value = statistics.median(known) if len(known) == len(values) and known else None
    return SloPoint(load=load, values=values, failed_requests=failed, ok_requests=ok, value=value,
                    passed=failed == 0 and value is not None and value <= opts.slo_s)


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
        n = slo.requests_per_point or max(16, 4 * math.ceil(load))
        if base.mode == "closed":
            opts = replace(base, concurrency=int(load), max_requests=n, conversation_offset=state["offset"],
                           progress=False)
        else:
            opts = replace(base, mode="open", rate=load, max_requests=n, conversation_offset=state["offset"],
                           progress=False)
        result = asyncio.run(replay_conversations(convs, url, opts))
        state["offset"] += result.summary["conversations_started"]
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            stem = f"load-{load:g}-r{repeat}"
            (out_dir / f"{stem}.jsonl").write_text("".join(r.to_json() + "\n" for r in result.records))
            write_json(out_dir / f"{stem}.summary.json", result.summary)
        return result.summary, result.records

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
