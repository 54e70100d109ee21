"""``kvtier bench prefetch``: queue-time prefetch (``connector.prefetch_ram``) on a second replica whose
only source of history is the shared tier.

The run, one fresh vLLM server after another (``kvtier.bench.compare.run_compare``, fixed history so
that every server receives identical prompts):

1. ``writer``: kvtier with a RAM tier and the shared tier (a fresh ``sharedfs`` directory), replays
   the workload and so fills the shared tier with every prompt's KV, as the replica that served
   the conversations first;
2. for each shared-tier latency (``store.faults`` latency on the shared tier only: 0 = the directory
   as it is, > 0 = a remote store that answers that much slower per read and lookup), two readers
   with fresh local tiers (an empty RAM tier, no SSD) over the same shared directory, which the
   writer left as it was: ``reader-<ms>ms`` without prefetch and ``reader-<ms>ms-prefetch`` with
   ``connector.prefetch_ram``. Both replay the same requests as the writer.

Figures per reader (``PrefetchPoint``): the returning turns' (turns after a conversation's first)
TTFT mean and p90 as the client saw them, the token hit rate, the prompt tokens admitted as hits
from RAM vs from the shared tier (prefetch moves shared-tier reads ahead of admission, so its hits
become RAM hits), the mean synchronous load time per request, the server's own queue time and the
prefetch outcome counts. ``ratios`` gives, per latency, reader / reader-prefetch for the returning
turns' mean and p90 TTFT (> 1: prefetch is faster). Side effects: servers, the shared directory
(removed afterwards unless ``keep_shared``) and the compare report under ``out``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.server import ServerSpec

WRITER = "writer"


@dataclass(frozen=True)
class PrefetchBenchOptions:
    """The servers of the benchmark: every one gets the same engine (model, dtype, KV space, length)."""

    model: str
    dtype: str = "auto"
    kv_cache_space_gib: float = 0.25
    max_model_len: int = 4096
    chunk_size: int = 128
    ram_bytes: int = 256 * 2**20
    prefetch_bytes: int = 128 * 2**20
    latencies_ms: tuple[float, ...] = (0.0, 50.0)

    def check(self) -> None:
        """Raise ValueError naming the first bad option."""
        if not self.latencies_ms:
            raise ValueError("at least one shared-tier latency is needed")
        if any(x < 0 for x in self.latencies_ms):
            raise ValueError(f"shared-tier latencies must be >= 0 ms, got {list(self.latencies_ms)}")
        if len(set(self.latencies_ms)) != len(self.latencies_ms):
            raise ValueError(f"shared-tier latencies must be distinct, got {list(self.latencies_ms)}")
        if self.prefetch_bytes <= 0:
            raise ValueError("the prefetch budget must be > 0 bytes")
        if self.prefetch_bytes > self.ram_bytes:
            raise ValueError(f"the prefetch budget ({self.prefetch_bytes} B) must fit in the RAM tier "
                             f"({self.ram_bytes} B)")


def reader_name(latency_ms: float, prefetch: bool) -> str:
    return f"reader-{latency_ms:g}ms" + ("-prefetch" if prefetch else "")


def prefetch_specs(opts: PrefetchBenchOptions, shared_dir: Path) -> list[ServerSpec]:
    """writer, then per latency a reader without and with prefetch (side-effect free)."""
    opts.check()
    shared = {"kind": "sharedfs", "path": str(shared_dir), "create": True}
    common = dict(model=opts.model, dtype=opts.dtype, kv_cache_space_gib=opts.kv_cache_space_gib,
                  max_model_len=opts.max_model_len)

    def kvtier(latency_ms: float | None, prefetch: bool) -> dict[str, Any]:
        # fixed history never sends a generated reply back: its chunks would only be written
        cfg: dict[str, Any] = {"store": {"chunk_size": opts.chunk_size, "memory": {"capacity": opts.ram_bytes},
                                         "disk": {"enabled": False}, "shared": dict(shared)},
                               "connector": {"save_generated": False,
                                             "prefetch_ram": opts.prefetch_bytes if prefetch else 0}}
        if latency_ms:
            cfg["store"]["faults"] = {"wraps": "shared", "latency_ms": latency_ms}
        return cfg

    specs = [ServerSpec(name=WRITER, kvtier_config=kvtier(None, False), **common)]
    for ms in opts.latencies_ms:
        for prefetch in (False, True):
            specs.append(ServerSpec(name=reader_name(ms, prefetch), kvtier_config=kvtier(ms, prefetch), **common))
    return specs


@dataclass(frozen=True)
class PrefetchPoint:
    """One reader's figures (see the module docstring)."""

    name: str
    latency_ms: float
    prefetch: bool
    requests_ok: int
    returning_requests: int
    returning_ttft_mean_s: float | None
    returning_ttft_p90_s: float | None
    ttft_mean_s: float | None
    token_hit_rate: float | None
    hit_tokens_ram: float
    hit_tokens_shared: float
    load_seconds_mean: float | None
    queue_seconds_mean: float | None
    prefetch_chunks: dict[str, float] = field(default_factory=dict)


def _kv(server: dict[str, Any], name: str) -> float:
    return float((server.get("kvtier") or {}).get(name) or 0.0)


def point_from_summary(name: str, latency_ms: float, prefetch: bool, summary: dict[str, Any]) -> PrefetchPoint:
    """A reader's ``PrefetchPoint`` from its replay summary (client figures + the servers' metrics)."""
    server = summary.get("server") or {}
    later = summary.get("later_turns") or {}
    kv = server.get("kvtier") or {}
    loads = _kv(server, "kvtier_connector_load_seconds_count")
    prefix = "kvtier_connector_prefetch_chunks_total{outcome="
    outcomes = {k[len(prefix):-1]: float(v) for k, v in kv.items() if k.startswith(prefix)}
    queue = ((server.get("phases") or {}).get("queue") or {}).get("mean_s")
    return PrefetchPoint(
        name=name, latency_ms=latency_ms, prefetch=prefetch, requests_ok=int(summary.get("requests_ok") or 0),
        returning_requests=int(later.get("requests") or 0), returning_ttft_mean_s=later.get("ttft_mean_s"),
        returning_ttft_p90_s=later.get("ttft_p90_s"), ttft_mean_s=summary.get("ttft_mean_s"),
        token_hit_rate=summary.get("token_hit_rate"),
        hit_tokens_ram=_kv(server, "kvtier_connector_hit_tokens_total{tier=memory}"),
        hit_tokens_shared=_kv(server, "kvtier_connector_hit_tokens_total{tier=shared}"),
        load_seconds_mean=_kv(server, "kvtier_connector_load_seconds_sum") / loads if loads else None,
        queue_seconds_mean=queue, prefetch_chunks=outcomes)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def prefetch_ratios(points: Sequence[PrefetchPoint]) -> dict[str, dict[str, float | None]]:
    """Per latency (``"<ms>ms"``): reader / reader-prefetch for the returning turns' TTFT mean and p90."""
    by = {(p.latency_ms, p.prefetch): p for p in points}
    out: dict[str, dict[str, float | None]] = {}
    for (ms, prefetch), off in sorted(by.items()):
        on = by.get((ms, True))
        if prefetch or on is None:
            continue
        out[f"{ms:g}ms"] = {"returning_ttft_mean": _div(off.returning_ttft_mean_s, on.returning_ttft_mean_s),
                            "returning_ttft_p90": _div(off.returning_ttft_p90_s, on.returning_ttft_p90_s)}
    return out


@dataclass
class PrefetchBenchResult:
    points: list[PrefetchPoint]
    ratios: dict[str, dict[str, float | None]]
    writer: dict[str, Any] | None
    errors: dict[str, str]
    report_path: Path | None

    def to_dict(self) -> dict[str, Any]:
        return {"points": [asdict(p) for p in self.points], "ratios": self.ratios, "errors": self.errors,
                "writer": {k: (self.writer or {}).get(k) for k in ("requests_ok", "ttft_mean_s", "token_hit_rate")},
                "report": str(self.report_path) if self.report_path else None}


def run_prefetch_bench(workload: Path, opts: PrefetchBenchOptions, out: Path, replay_options: Any, *,
                       keep_shared: bool = False, start_server: Callable | None = None,
                       on_event: Callable[[str], None] = lambda m: None) -> PrefetchBenchResult:
    """Run the writer and the readers (``prefetch_specs``) on ``workload``; write ``out/prefetch.json``."""
    from kvtier.bench.compare import run_compare
    from kvtier.demo.common import write_json

    if replay_options.history != "workload":
        raise ValueError("the prefetch benchmark needs fixed history (--history workload): the readers must "
                         "send the writer's prompts")
    out.mkdir(parents=True, exist_ok=True)
    shared_dir = Path(tempfile.mkdtemp(prefix="shared-", dir=out))
    try:
        specs = prefetch_specs(opts, shared_dir)
        kw = {"start_server": start_server} if start_server is not None else {}
        res = run_compare(workload, specs, out, replay_options, on_event=on_event,
                          title=f"queue-time prefetch: {Path(workload).name}", **kw)
    finally:
        if not keep_shared:
            shutil.rmtree(shared_dir, ignore_errors=True)
    lat = {reader_name(ms, p): (ms, p) for ms in opts.latencies_ms for p in (False, True)}
    points = [point_from_summary(r.name, *lat[r.name], r.summary) for r in res.runs
              if r.name in lat and r.summary]
    errors = {r.name: r.error for r in res.runs if r.error}
    writer = next((r.summary for r in res.runs if r.name == WRITER), None)
    result = PrefetchBenchResult(points=points, ratios=prefetch_ratios(points), writer=writer, errors=errors,
                                 report_path=res.report_path)
    write_json(out / "prefetch.json", result.to_dict())
    return result
