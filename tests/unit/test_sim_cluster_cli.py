"""`kvtier simulate --replicas N --routing ...` and `kvtier plan --replicas N`: outputs and one-line errors."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from kvtier.commands import sim_cmd
from tests.unit.test_sim_cluster_routing import mooncake

app = typer.Typer()


@app.callback()
def _group() -> None:
    """A command group (so the first argument names the command)."""


sim_cmd.register(app)
runner = CliRunner()
SMALL = ["--kv-bytes-per-token", "1000", "--kv-cache-tokens", "20000", "--mode", "trace"]


def test_simulate_a_cluster_writes_its_json(tmp_path) -> None:
    wl = mooncake(tmp_path / "m.jsonl", 60, 4, 3)
    js = tmp_path / "c.json"
    r = runner.invoke(app, ["simulate", str(wl), *SMALL, "--memory-capacity", "20MB", "--shared-capacity", "1GB",
                            "--replicas", "3", "--routing", "kv-aware", "--json", str(js),
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "3 replicas, kv-aware" in r.output and "per replica" in r.output
    d = json.loads(js.read_text())
    assert d["replicas"] == 3 and d["routing"] == "kv-aware" and d["shared"] is True
    assert sum(p["requests"] for p in d["per_replica"]) == d["requests"] == 60
    assert set(d["tier_hit_rate"]) == {"gpu", "ram", "ssd", "shared"}
    assert json.loads((tmp_path / "o" / "cluster.json").read_text())["requests"] == 60


def test_plan_sizes_a_clusters_shared_tier(tmp_path) -> None:
    wl = mooncake(tmp_path / "m.jsonl", 80, 4, 3)
    js = tmp_path / "p.json"
    r = runner.invoke(app, ["plan", str(wl), "--kv-cache-tokens", "4000", "--mode", "trace", "--replicas", "2",
                            "--memory-capacity", "1GB", "--json", str(js)])
    assert r.exit_code == 0, r.output
    d = json.loads(js.read_text())
    assert d["replicas"] == 2 and d["knee_bytes"] > 0 and d["candidates"]
    c = d["candidates"][0]
    assert c["shared_bytes"] == d["knee_bytes"] and c["shared_read_bw"] >= 0
    assert c["shared_read_bw_per_replica"] == pytest.approx(c["shared_read_bw"] / 2)
    assert "token_hit_rate" in d["local_only"]


@pytest.mark.parametrize("args, msg", [
    (["simulate", "--routing", "sticky"], "--routing needs --replicas"),
    (["simulate", "--replicas", "0"], "--replicas must be >= 1"),
    (["simulate", "--replicas", "2", "--routing", "random"], "--routing must be one of"),
    (["plan", "--memory-capacity", "1GB"], "apply with --replicas"),
    (["plan", "--replicas", "2", "--shared-tier"], "implied by --replicas"),
    (["plan", "--replicas", "2", "--target-ttft", "1"], "not supported with --replicas"),
])
def test_bad_cluster_options_are_one_line_errors(tmp_path, args, msg) -> None:
    wl = mooncake(tmp_path / "m.jsonl", 5, 2, 1)
    r = runner.invoke(app, [args[0], str(wl), *args[1:]])
    assert r.exit_code == 2
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and msg in lines[0], r.output
