"""Where ``kvtier stats`` finds kvtier's metrics, and how samples of several processes merge.

Process model (``kvtier.integrations.vllm.metrics``): kvtier's counters live in vLLM's engine
processes. vLLM's ``/metrics`` is the API server process's registry: it lists the ``kvtier_*``
families too (vLLM imports the connector class there) but they stay at zero, so they are ignored
unless no kvtier endpoint answers and they are not all zero (Prometheus multiprocess mode, where
vLLM's ``/metrics`` aggregates every process). The scheduler process serves kvtier's metrics on
``metrics.port`` and worker rank r on ``metrics.port + 1 + r``.

Contracts:
- ``discover(base_url, metrics_port)``: for a vLLM server URL (``http://host:8000``), vLLM's own
  cache counters from ``/metrics`` plus one ``Source`` per kvtier process found on the same host:
  the scheduler at ``metrics_port`` and workers at ``+1, +2, ...`` until one does not answer (vLLM's
  ``/metrics`` instead where it carries non-zero kvtier samples and no port answers). A URL
  whose path ends in ``/metrics`` is read as one endpoint, nothing discovered. Raises
  ``SourceError`` (one line) when no kvtier metrics answer.
- ``merge``: samples with equal names and labels are summed, except the gauges of one tier that
  several processes see (``kvtier_tier_usage_bytes``/``_capacity_bytes`` of the SSD or a shared
  tier: the largest value is kept); RAM tiers are per process and summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

VLLM_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                 "vllm:external_prefix_cache_hits", "vllm:prompt_tokens", "vllm:request_success")
SHARED_GAUGES = ("kvtier_tier_usage_bytes", "kvtier_tier_capacity_bytes")
MAX_WORKERS = 64


class SourceError(RuntimeError):
    """No kvtier metrics could be read; the message (one line) says where it looked."""


@dataclass
class Source:
    """One endpoint that answered with kvtier samples."""

    url: str
    role: str                                   # scheduler, worker N, vLLM /metrics, endpoint
    samples: dict[str, float] = field(default_factory=dict)


def parse(text: str, prefixes: tuple[str, ...] = ("kvtier_",), keep_labels: bool = True) -> dict[str, float]:
    """Prometheus text as ``{"name{label=value,...}": value}`` for names starting with ``prefixes``
    (``_created`` samples dropped; ``keep_labels`` False sums each name over its label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(prefixes) or s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) if keep_labels else ""
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def merge(samples: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        for k, v in s.items():
            if k.endswith("_created"):
                continue
            if k.split("{", 1)[0] in SHARED_GAUGES and "tier=memory" not in k:
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v
    return out


def _get(client: httpx.Client, url: str) -> str | None:
    """The body of ``url`` (None: nothing answers there, or not with 200)."""
    try:
        r = client.get(url)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def read_endpoint(url: str, client: httpx.Client | None = None) -> Source:
    """One Prometheus endpoint as given; SourceError if it does not answer."""
    with (client or httpx.Client(timeout=5.0)) as c:
        text = _get(c, url)
    if text is None:
        raise SourceError(f"cannot read {url}")
    return Source(url, "endpoint", parse(text))


def discover(base_url: str, metrics_port: int, client: httpx.Client | None = None
             ) -> tuple[list[Source], dict[str, float]]:
    """kvtier's metric sources behind a vLLM server, and vLLM's own cache counters (see the contract)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError(f"--base-url {base_url!r} is not an http(s) URL like http://127.0.0.1:8000")
    if parts.path.rstrip("/").endswith("/metrics"):
        return [read_endpoint(base_url, client)], {}
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    vllm_url = base_url.rstrip("/") + "/metrics"
    with (client or httpx.Client(timeout=3.0)) as c:
        text = _get(c, vllm_url)
        vllm = parse(text, VLLM_COUNTERS, keep_labels=False) if text is not None else {}
        own = parse(text) if text is not None else {}
        sources: list[Source] = []
        for i in range(MAX_WORKERS + 1):
            url = f"http://{host}:{metrics_port + i}/metrics"
            body = _get(c, url)
            samples = parse(body) if body is not None else {}
            if samples:
                sources.append(Source(url, "scheduler" if i == 0 else f"worker {i - 1}", samples))
            elif i >= 1:                          # the scheduler may be missing; ranks are contiguous
                break
    if not sources and any(own.values()):         # multiprocess mode: every process's samples are here
        return [Source(vllm_url, "vLLM /metrics", own)], vllm
    if not sources:
        reach = "" if text is not None else f"; vLLM's {vllm_url} did not answer either"
        raise SourceError(f"no kvtier metrics at http://{host}:{metrics_port}/metrics or :{metrics_port + 1} "
                          f"(the server's metrics.port; kvtier serve uses 9400 unless --metrics-port){reach}")
    return sources, vllm
