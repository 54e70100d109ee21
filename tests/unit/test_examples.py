"""Every file in examples/ is valid: kvtier configs load through the real loader and build a
``kvtier serve --dry-run`` command, the compare configs load through compare's loader, the
Kubernetes manifests parse and their ConfigMap's kvtier configs load, and the Grafana dashboard
queries only metrics kvtier (or vLLM) exports."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvtier.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KVTIER_CONFIGS = sorted(p for p in EXAMPLES.glob("*.yaml") if p.name != "bench-compare.yaml")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))


def test_the_examples_are_there_and_listed():
    names = {p.name for p in KVTIER_CONFIGS}
    assert {"single-machine.yaml", "juicefs.yaml", "valkey.yaml", "valkey-cluster.yaml", "mooncake.yaml"} <= names
    readme = (EXAMPLES / "README.md").read_text()
    for p in [*EXAMPLES.glob("*.yaml"), *EXAMPLES.glob("*.json"), *(EXAMPLES / "kubernetes").glob("*.yaml")]:
        assert p.name in readme, f"examples/README.md does not mention {p.name}"


@pytest.mark.parametrize("path", KVTIER_CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(path, env={})
    assert cfg.metrics.port == 9400
    if path.name != "single-machine.yaml":
        assert cfg.store.shared is not None
    for line in path.read_text().splitlines():                 # secrets come from the environment
        assert "password:" not in line.split("#")[0], line


@pytest.mark.parametrize("path", KVTIER_CONFIGS, ids=lambda p: p.name)
def test_serve_dry_run_builds_a_command(path, monkeypatch):
    import kvtier.commands.serve_cmd as serve_cmd
    from kvtier.cli import _register_all, app

    if not any(c.name == "serve" for c in app.registered_commands):
        _register_all()
    monkeypatch.setattr(serve_cmd, "cpu_backend", lambda: False)
    r = runner.invoke(app, ["serve", "Qwen/Qwen2.5-7B-Instruct", "--config", str(path), "--dry-run",
                            "--max-model-len", "8192"])
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.stdout)
    kvt = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    written = Path(kvt["kv_connector_extra_config"]["kvtier_config_file"])
    assert load_config(written, env={}).store == load_config(path, env={}).store
    assert argv[-2:] == ["--max-model-len", "8192"]


def test_bench_compare_configs_load():
    from kvtier.bench.compare import load_compare_specs

    specs = load_compare_specs(EXAMPLES / "bench-compare.yaml", model="/models/m")
    assert [s.name for s in specs][0] == "vllm-baseline" and specs[0].kvtier_config is None
    by_name = {s.name: s for s in specs}
    from_file = by_name["kvtier-single-machine"].kvtier_config
    assert from_file["store"]["disk"]["enabled"] and from_file["store"]["disk"]["path"] is None  # fresh per run
    assert all(s.model == "/models/m" for s in specs)


def _manifests() -> list[dict]:
    docs = []
    for p in sorted((EXAMPLES / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return docs


def test_kubernetes_manifests_parse_and_their_kvtier_configs_load(tmp_path):
    docs = _manifests()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("ConfigMap", "kvtier-config"), ("Deployment", "vllm-kvtier"), ("Service", "valkey"),
            ("PersistentVolumeClaim", "kvtier-shared")} <= kinds
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    for key, text in cm["data"].items():
        f = tmp_path / key
        f.write_text(text)
        assert load_config(f, env={}).store.shared is not None, key
    vllm = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-kvtier")
    pod = vllm["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kvtier-config")
    assert Path(env["KVTIER_CONFIG_FILE"]["value"]).parent == Path(mount["mountPath"])
    assert Path(env["KVTIER_CONFIG_FILE"]["value"]).name in cm["data"]
    assert "secretKeyRef" in env["KVTIER_STORE__SHARED__PASSWORD"]["valueFrom"]
    kvt = json.loads(container["command"][container["command"].index("--kv-transfer-config") + 1])
    assert kvt["kv_connector"] == "KvtierConnector" and "kv_connector_extra_config" not in kvt


def _exported_names() -> set[str]:
    """Every sample name kvtier's metric modules export (counters as _total, histograms' series)."""
    from prometheus_client import REGISTRY

    import kvtier.integrations.vllm.metrics  # noqa: F401  (registers the connector's metrics)
    import kvtier.metrics  # noqa: F401

    names: set[str] = set()
    for fam in REGISTRY.collect():
        if not fam.name.startswith("kvtier_"):
            continue
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(fam.name)
    return names


def test_grafana_dashboard_queries_real_metrics():
    from kvtier.client.server_metrics import EXTERNAL_HITS, EXTERNAL_QUERIES, PREFIX_HITS, PREFIX_QUERIES

    dash = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    exported = _exported_names()
    vllm_names = {n + "_total" for n in (PREFIX_HITS, PREFIX_QUERIES, EXTERNAL_HITS, EXTERNAL_QUERIES)}
    used = {n for e in exprs for n in re.findall(r"\b(kvtier_[a-z_]+|vllm:[a-z_]+)", e)}
    assert {n for n in used if n.startswith("kvtier_")} - exported == set()
    assert {n for n in used if n.startswith("vllm:")} - vllm_names == set()
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("hit rate", "loaded", "latency", "unavailable", "corrupt", "capacity"):
        assert topic in titles, topic
