"""kvtier serve (dry run), kvtier stats (snapshots and --url), connector metric snapshots."""

from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from kvtier.cli import _register_all, app
from kvtier.integrations.vllm.metrics import ConnectorMetrics, SnapshotWriter, kvtier_samples, write_snapshot

_register_all()
runner = CliRunner()


def test_serve_dry_run_builds_the_vllm_command(tmp_path):
    import kvtier.compute

    kvtier.compute._announced.clear()     # the dtype line is said once per process: another test may have
    r = runner.invoke(app, ["serve", "--dry-run", "--disk", str(tmp_path / "ssd"), "--ram", "1GiB",
                            "--model", str(tmp_path), "--", "--max-model-len", "8192"])
    assert r.exit_code == 0, r.output
    argv = r.stdout.split()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in argv and argv[-2:] == ["--max-model-len", "8192"]
    assert argv[argv.index("--dtype") + 1] in ("float32", "bfloat16")    # auto, said on stderr with the reason
    assert "dtype" in r.stderr and "auto" in r.stderr
    kvt = json.loads(r.stdout.split("--kv-transfer-config ", 1)[1].split(" --enforce-eager")[0])
    assert kvt["kv_connector"] == "KvtierConnector"
    assert kvt["kv_connector_module_path"] == "kvtier.integrations.vllm.connector"
    cfg = kvt["kv_connector_extra_config"]["kvtier_config"]
    assert cfg["store"]["disk"] == {**cfg["store"]["disk"], "enabled": True, "path": str(tmp_path / "ssd")}
    assert cfg["store"]["memory"]["capacity"] == 2**30


def test_serve_refuses_chunk_size_not_multiple_of_block():
    r = runner.invoke(app, ["serve", "--dry-run", "--chunk-size", "200"])
    assert r.exit_code == 2
    r = runner.invoke(app, ["serve", "--dry-run", "--chunk-size", "192", "--", "--block-size", "64"])
    assert r.exit_code == 0, r.output


def test_serve_bad_ram_size():
    r = runner.invoke(app, ["serve", "--dry-run", "--ram", "lots"])
    assert r.exit_code == 2


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
    r = runner.invoke(app, ["stats", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    merged = json.loads(r.output)
    assert merged["kvtier_connector_loaded_tokens_total"] == doc["samples"]["kvtier_connector_loaded_tokens_total"] + 100
    r = runner.invoke(app, ["stats", str(tmp_path), "--json", "--live-only"])
    assert json.loads(r.output)["kvtier_connector_loaded_tokens_total"] == \
        doc["samples"]["kvtier_connector_loaded_tokens_total"]
    r = runner.invoke(app, ["stats", str(tmp_path)])
    assert r.exit_code == 0 and "tokens loaded" in r.output


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
    from kvtier.server import free_port

    port = free_port()
    assert serve(port)
    ConnectorMetrics().stored(4096, 0.001, dropped=False)
    r = runner.invoke(app, ["stats", "--url", f"http://127.0.0.1:{port}/metrics", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kvtier_connector_stored_chunks_total"] >= 1


def test_serve_dtype_forced_bad_and_passthrough(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_DTYPE", raising=False)
    r = runner.invoke(app, ["serve", "--dry-run", "--model", str(tmp_path), "--dtype", "float16"])
    assert r.exit_code == 0, r.output
    assert r.stdout.split().count("--dtype") == 1 and "--dtype float16" in r.stdout
    r = runner.invoke(app, ["serve", "--dry-run", "--model", str(tmp_path), "--", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert r.stdout.split().count("--dtype") == 1 and "--dtype bfloat16" in r.stdout
    r = runner.invoke(app, ["serve", "--dry-run", "--model", str(tmp_path), "--dtype", "int4"])
    assert r.exit_code != 0 and "int4" in r.output
