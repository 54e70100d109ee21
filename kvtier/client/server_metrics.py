"""Server-side counters from Prometheus ``/metrics``, snapshotted before and after a run.

A ``MetricsSnapshot`` maps sample name -> value (vLLM samples summed over label sets, so
multi-engine or per-model labels collapse; ``kvtier_*`` samples keep their labels). ``server_delta`` turns two snapshots into the server's own
view of the run: prefix-cache token hit rate, mean TTFT from vLLM's histogram, where a request's
time went (``phases``: queue / prefill / decode / TTFT / e2e, count, total and mean seconds from
vLLM's histograms' ``_sum`` and ``_count``), and the change of every ``kvtier_*`` sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX_HITS = "vllm:prefix_cache_hits"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries"
TTFT_HIST = "vllm:time_to_first_token_seconds"
#: vLLM's per-request phase histograms (``vllm/v1/metrics/loggers.py``): time waiting in the engine's
#: queue, prefilling (scheduled -> first token), decoding (first -> last token), TTFT as the API
#: server sees it, and end to end
PHASE_HISTS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
               "decode": "vllm:request_decode_time_seconds", "ttft": TTFT_HIST,
               "e2e": "vllm:e2e_request_latency_seconds"}
_TRACKED_PREFIXES = ("vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:prompt_tokens",
                     "vllm:request_success", "vllm:num_preemptions", *PHASE_HISTS.values(), "kvtier_")


@dataclass(frozen=True)
class MetricsSnapshot:
    samples: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def get(self, name: str) -> float | None:
        """Value of a counter, accepting the name with or without ``_total``."""
        for n in (name, name + "_total"):
            if n in self.samples:
                return self.samples[n]
        return None


def parse_metrics(text: str) -> MetricsSnapshot:
    """vLLM samples are summed over label sets; ``kvtier_*`` samples keep their labels
    (``kvtier_store_hits_total{tier=disk}``). Histogram buckets and ``_created`` are dropped."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(_TRACKED_PREFIXES) or s.name.endswith(("_created", "_bucket")):
                continue
            key = s.name
            if s.name.startswith("kvtier_") and s.labels:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            samples[key] = samples.get(key, 0.0) + float(s.value)
    return MetricsSnapshot(samples)


async def scrape(client: httpx.AsyncClient, url: str) -> MetricsSnapshot:
    """Never raises: an unreachable or malformed endpoint gives a snapshot with ``error``."""
    try:
        r = await client.get(url, timeout=10.0)
        r.raise_for_status()
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError) as e:
        return MetricsSnapshot(error=f"{url}: {type(e).__name__}: {e}")


def merge(snapshots: list[tuple[MetricsSnapshot, bool]]) -> MetricsSnapshot:
    """Add up several endpoints' samples; ``kvtier_*`` samples only from endpoints flagged as
    kvtier's own (the vLLM API server imports the connector module, so it exports every
    ``kvtier_*`` series at 0 although its process never runs the connector: those zeros are not
    measurements). Side-effect free."""
    samples: dict[str, float] = {}
    errors = [snap.error for snap, _ in snapshots if snap.error]
    for snap, kvtier_own in snapshots:
        for k, v in snap.samples.items():
            if k.startswith("kvtier_") and not kvtier_own:
                continue
            samples[k] = samples.get(k, 0.0) + v
    return MetricsSnapshot(samples, "; ".join(errors) or None)


async def scrape_all(client: httpx.AsyncClient, urls: list[str],
                     kvtier_urls: tuple[str, ...] = ()) -> MetricsSnapshot:
    """Scrape several endpoints (vLLM's, kvtier's own) into one snapshot; samples add up;
    ``kvtier_*`` series are kept only from ``kvtier_urls`` (see ``merge``)."""
    return merge([(await scrape(client, url), url in kvtier_urls) for url in urls])


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> float | None:
    a, b = after.get(name), before.get(name)
    if a is None:
        return None
    return a - (b or 0.0)


def phase_times(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, dict[str, float | None]]:
    """Per phase of ``PHASE_HISTS``: requests observed, total and mean seconds over the run (None
    where the server does not export the histogram or observed nothing). Side-effect free."""
    out: dict[str, dict[str, float | None]] = {}
    for phase, name in PHASE_HISTS.items():
        total, count = _delta(before, after, name + "_sum"), _delta(before, after, name + "_count")
        out[phase] = {"count": count, "sum_s": total,
                      "mean_s": total / count if total is not None and count else None}
    return out


def server_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, Any]:
    """Server-side view of one run (keys are None when the server does not export them)."""
    hits, queries = _delta(before, after, PREFIX_HITS), _delta(before, after, PREFIX_QUERIES)
    ext_hits, ext_queries = _delta(before, after, EXTERNAL_HITS), _delta(before, after, EXTERNAL_QUERIES)
    ttft_sum, ttft_count = _delta(before, after, TTFT_HIST + "_sum"), _delta(before, after, TTFT_HIST + "_count")
    out: dict[str, Any] = {
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
        "external_prefix_cache_hits": ext_hits, "external_prefix_cache_queries": ext_queries,
        "external_prefix_cache_hit_rate": ext_hits / ext_queries if ext_hits is not None and ext_queries else None,
        "ttft_count": ttft_count,
        "ttft_mean_s": ttft_sum / ttft_count if ttft_sum is not None and ttft_count else None,
        "phases": phase_times(before, after),
        # only from kvtier's own endpoints (empty when none was scraped: never API-server zeros)
        "kvtier": {k: after.samples[k] - before.samples.get(k, 0.0)
                   for k in sorted(after.samples) if k.startswith("kvtier_")},
        "errors": [e for e in (before.error, after.error) if e],
    }
    return out
