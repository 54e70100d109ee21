"""Time bounds never change what is compared.

A configuration that hits its time bound (or loses requests) has served fewer requests than the
workload holds; comparing its mean TTFT with another configuration's full run would compare
different request sets (the easy early turns against the whole workload). ``same_requests`` finds
the requests every configuration served successfully — a request is (conversation id, turn) — and
re-summarizes each configuration on exactly those; the result says whether the run was complete
and how many requests each configuration served. Side-effect free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kvtier.client.stream import RequestRecord
from kvtier.client.summary import summarize

RequestKey = tuple[str, int]


def request_key(rec: RequestRecord) -> RequestKey:
    return rec.conversation_id, rec.turn


@dataclass(frozen=True)
class ConfigCount:
    planned: int
    ok: int
    failed: int
    cancelled: int
    stopped_reason: str | None

    @property
    def complete(self) -> bool:
        return self.ok == self.planned and self.failed == 0

    def to_dict(self) -> dict[str, Any]:
        return {"planned": self.planned, "ok": self.ok, "failed": self.failed, "cancelled": self.cancelled,
                "stopped_reason": self.stopped_reason, "complete": self.complete}


@dataclass
class SameRequests:
    """Completeness of a comparison and every configuration's summary on the common requests."""

    complete: bool
    planned: int
    common: int
    counts: dict[str, ConfigCount]
    summaries: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def incomplete(self) -> list[str]:
        return [n for n, c in self.counts.items() if not c.complete]

    def to_dict(self) -> dict[str, Any]:
        return {"complete": self.complete, "planned_requests": self.planned, "compared_requests": self.common,
                "requests": {n: c.to_dict() for n, c in self.counts.items()}}


def same_requests(records: Mapping[str, Sequence[RequestRecord]], summaries: Mapping[str, dict[str, Any] | None],
                  planned: int, windows: int = 10) -> SameRequests:
    """Compare on the requests every configuration served; full summaries are kept when complete.

    ``records``/``summaries`` are per configuration (a configuration whose run failed has no summary
    and counts as having served nothing).
    """
    counts: dict[str, ConfigCount] = {}
    served: list[set[RequestKey]] = []
    for name, recs in records.items():
        s = summaries.get(name) or {}
        ok = {request_key(r) for r in recs if r.ok}
        served.append(ok)
        counts[name] = ConfigCount(planned=planned, ok=len(ok), failed=sum(not r.ok for r in recs),
                                   cancelled=int(s.get("requests_cancelled") or 0),
                                   stopped_reason=s.get("stopped_reason") if s else "no results")
    common = set.intersection(*served) if served else set()
    complete = all(c.complete for c in counts.values()) and len(common) == planned
    out = SameRequests(complete=complete, planned=planned, common=len(common), counts=counts)
    for name, recs in records.items():
        full = summaries.get(name)
        if complete or not full:
            out.summaries[name] = full
            continue
        kept = [r for r in recs if r.ok and request_key(r) in common]
        extra = {k: full.get(k) for k in ("mode", "history", "concurrency", "url", "model", "stopped_reason",
                                          "requests_cancelled", "server")}
        extra["partial"] = True
        extra["requests_ok_full_run"] = full.get("requests_ok")
        out.summaries[name] = summarize(kept, duration_s=float(full.get("duration_s") or 0.0), windows=windows,
                                        extra=extra)
    return out
