"""kvtier stats (snapshots, --base-url discovery and merging, --json PATH), connector metric snapshots."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from kvtier.cli import _register_all, app
from kvtier.commands.stats_sources import SourceError
from kvtier.integrations.vllm.metrics import ConnectorMetrics, SnapshotWriter, kvtier_samples, write_snapshot

_register_all()
runner = CliRunner()


def test_snapshots_and_stats_from_directory(tmp_path):
    m = ConnectorMetrics()
    m.lookup()
    m.admitted(1000, {"disk": 512})
    m.loaded(1 << 20, 0.01, 512)
    m.error("load_miss")
    path = write_snapshot(tmp_path / "_stats", "worker")
    doc = json.loads(path.read_text())
    assert doc["pid"] == os.getpid() and doc["samples"] == kvtier_samples()
    assert doc["samples"]["kvtier_connector_hit_tokens_total{tier=disk}"] >= 512
    # a second (exited) process's snapshot is merged by summing
    other = dict(doc, pid=999999999, samples={"kvtier_connector_loaded_tokens_total": 100.0})
    (tmp_path / "_stats" / "worker-999999999.json").write_text(json.dumps(other))
    r = runner.invoke(app, ["stats", str(tmp_path), "--json", "-"])
    assert r.exit_code == 0, r.output
    merged = json.loads(r.stdout)
    assert merged["kvtier_connector_loaded_tokens_total"] == doc["samples"]["kvtier_connector_loaded_tokens_total"] + 100
    r = runner.invoke(app, ["stats", str(tmp_path), "--json", "--live-only"])      # the old switch form
    assert "deprecated" in r.stderr
    assert json.loads(r.stdout)["kvtier_connector_loaded_tokens_total"] == \
        doc["samples"]["kvtier_connector_loaded_tokens_total"]
    out = tmp_path / "out" / "stats.json"
    r = runner.invoke(app, ["stats", str(tmp_path), "--json", str(out)])
    assert r.exit_code == 0 and "tokens loaded" in r.stdout
    assert json.loads(out.read_text()) == merged


def test_snapshot_writer_writes_on_stop(tmp_path):
    w = SnapshotWriter.start(tmp_path, "scheduler", interval_s=60)
    w.stop()
    assert (tmp_path / f"scheduler-{os.getpid()}.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_stats_needs_a_source(tmp_path):
    assert runner.invoke(app, ["stats"]).exit_code != 0
    assert runner.invoke(app, ["stats", str(tmp_path)]).exit_code == 1


def test_stats_from_url(tmp_path):
    from kvtier.integrations.vllm.metrics import serve
    from kvtier.ports import free_port

    port = free_port()
    assert serve(port)
    ConnectorMetrics().stored(4096, 0.001, dropped=False)
    for flag in ("--base-url", "--url"):          # a /metrics URL is read as it is; --url: the old name
        r = runner.invoke(app, ["stats", flag, f"http://127.0.0.1:{port}/metrics", "--json", "-"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["kvtier_connector_stored_chunks_total"] >= 1


# ------------------------------------------------------------------ kvtier stats --base-url

SCHEDULER = """# TYPE kvtier_connector_lookups_total counter
kvtier_connector_lookups_total 10.0
# TYPE kvtier_connector_lookup_tokens_total counter
kvtier_connector_lookup_tokens_total 1000.0
# TYPE kvtier_connector_hit_tokens_total counter
kvtier_connector_hit_tokens_total{tier="disk"} 400.0
kvtier_connector_hit_tokens_total{tier="memory"} 100.0
# TYPE kvtier_tier_capacity_bytes gauge
kvtier_tier_capacity_bytes{tier="disk"} 1e9
# TYPE kvtier_tier_usage_bytes gauge
kvtier_tier_usage_bytes{tier="disk"} 3e8
"""
WORKER = """# TYPE kvtier_connector_loaded_tokens_total counter
kvtier_connector_loaded_tokens_total 500.0
# TYPE kvtier_connector_load_bytes_total counter
kvtier_connector_load_bytes_total 2e6
# TYPE kvtier_store_hits_total counter
kvtier_store_hits_total{tier="disk"} 7.0
# TYPE kvtier_tier_capacity_bytes gauge
kvtier_tier_capacity_bytes{tier="disk"} 1e9
kvtier_tier_capacity_bytes{tier="memory"} 2e9
# TYPE kvtier_tier_usage_bytes gauge
kvtier_tier_usage_bytes{tier="disk"} 3.5e8
kvtier_tier_usage_bytes{tier="memory"} 1e8
"""
VLLM = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 750.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 500.0
"""


class _Text:
    """A tiny HTTP server on 127.0.0.1 answering GET /metrics with fixed Prometheus text."""

    def __init__(self, text: str, port: int = 0) -> None:
        import http.server
        import threading

        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                code = 200 if self.path == "/metrics" else 404
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body) if code == 200 else 0))
                self.end_headers()
                if code == 200:
                    self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _port_pair() -> int:
    from kvtier.ports import free_port

    return free_port(2)


def test_stats_base_url_finds_and_merges_scheduler_and_worker():
    vllm = _Text(VLLM)
    p = _port_pair()
    servers = [vllm, _Text(SCHEDULER, p), _Text(WORKER, p + 1)]
    try:
        r = runner.invoke(app, ["stats", "--base-url", f"http://127.0.0.1:{vllm.port}", "--metrics-port", str(p),
                                "--json", "-"])
        assert r.exit_code == 0, r.output
        merged = json.loads(r.stdout)
        assert merged["kvtier_connector_lookups_total"] == 10          # scheduler only
        assert merged["kvtier_connector_loaded_tokens_total"] == 500    # worker only
        assert merged["kvtier_tier_capacity_bytes{tier=disk}"] == 1e9   # one SSD seen twice: not doubled
        assert merged["kvtier_tier_usage_bytes{tier=disk}"] == 3.5e8
        assert merged["kvtier_tier_capacity_bytes{tier=memory}"] == 2e9
        assert merged["vllm:external_prefix_cache_hits_total"] == 500   # vLLM's counters, summed over labels
        assert "scheduler" in r.stderr and "worker 0" in r.stderr       # the tables go to stderr with --json -
        r = runner.invoke(app, ["stats", "--url", f"http://127.0.0.1:{vllm.port}", "--metrics-port", str(p)])
        assert r.exit_code == 0, r.output
        assert "token hit rate" in r.stdout and "50.0%" in r.stdout     # 500 / 1000 prompt tokens
        assert "external (kvtier) hit rate" in r.stdout and "66.7%" in r.stdout
    finally:
        for s in servers:
            s.close()


def test_stats_base_url_with_nothing_there_is_one_line():
    p = _port_pair()
    r = runner.invoke(app, ["stats", "--base-url", f"http://127.0.0.1:{p}", "--metrics-port", str(p)])
    assert r.exit_code == 1
    assert "no kvtier metrics" in r.output and len(r.output.strip().splitlines()) == 1


def test_discover_ignores_the_api_servers_zero_kvtier_families():
    import httpx

    from kvtier.commands.stats_sources import discover

    zeros = "# TYPE kvtier_connector_lookups_total counter\nkvtier_connector_lookups_total 0.0\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 8000:
            return httpx.Response(200, text=VLLM + zeros)
        if request.url.port == 9400:
            return httpx.Response(200, text=SCHEDULER)
        raise httpx.ConnectError("refused", request=request)

    sources, _ = discover("http://h:8000", 9400, client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert [(s.role, s.url) for s in sources] == [("scheduler", "http://h:9400/metrics")]
    assert sources[0].samples["kvtier_connector_lookups_total"] == 10
    zeros_only = httpx.MockTransport(lambda r: httpx.Response(200, text=VLLM + zeros) if r.url.port == 8000
                                     else httpx.Response(404))
    with pytest.raises(SourceError, match="no kvtier metrics"):
        discover("http://h:8000", 9400, client=httpx.Client(transport=zeros_only))


def test_discover_uses_vllms_metrics_when_they_carry_every_process():
    import httpx

    from kvtier.commands.stats_sources import discover

    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.port == 8000:
            return httpx.Response(200, text=VLLM + SCHEDULER)
        raise httpx.ConnectError("refused", request=request)

    sources, vllm = discover("http://h:8000", 9400, client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert [s.role for s in sources] == ["vLLM /metrics"] and seen[0] == "http://h:8000/metrics"
    assert sources[0].samples["kvtier_connector_lookups_total"] == 10
    assert vllm["vllm:prefix_cache_hits_total"] == 250


def test_metrics_port_zero_is_off_for_every_process() -> None:
    """``metrics.port: 0`` turns metrics off in the scheduler and in every worker (a worker once took
    0 + 1 + rank and tried to bind port 1)."""
    from kvtier.integrations.vllm.metrics import metrics_port

    assert metrics_port(9400, None) == 9400 and metrics_port(9400, 0) == 9401 and metrics_port(9400, 3) == 9404
    for off in (None, 0):
        assert metrics_port(off, None) is None and metrics_port(off, 0) is None and metrics_port(off, 2) is None
