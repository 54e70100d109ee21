"""`kvtier bench run|slo|compare` on the command line (typer runner, fake server)."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from kvtier.commands import bench_cmd
from kvtier.ports import free_port
from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer
from tests.unit.test_bench_replay import make_workload
from tests.unit.virtual_time import virtual_time  # noqa: F401

app = typer.Typer()
bench_cmd.register(app)
runner = CliRunner()


def test_bench_run_writes_records_and_summary(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=3, n_turns=2)
    with FakeOpenAIServer.start(FakeBehavior(first_token_delay_s=0.01)) as srv:
        r = runner.invoke(app, ["run", str(wl), "--base-url", srv.url, "--mode", "closed", "--max-concurrency", "2",
                                "--out", str(tmp_path / "out"), "--json", str(tmp_path / "s.json"), "--no-progress"])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["requests_ok"] == 6 and s["ttft_p99_s"] > 0 and s["token_hit_rate"] is not None
    assert len((tmp_path / "out" / "requests.jsonl").read_text().splitlines()) == 6
    assert "TTFT mean" in r.output


def test_bench_run_rejects_open_loop_without_rate(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl")
    r = runner.invoke(app, ["run", str(wl), "--base-url", "http://127.0.0.1:1", "--mode", "open"])
    assert r.exit_code == 2 and "rate" in r.output


def test_bench_run_unreachable_server_is_one_clear_error(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl")
    r = runner.invoke(app, ["run", str(wl), "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress",
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "cannot reach server" in r.output


def test_bench_slo_prints_the_curve(tmp_path, virtual_time):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=100, n_turns=1)
    # 0.2 s of TTFT per active request: 2 users = 0.4 s, 3 users = 0.6 s, the SLO 0.5 s; in virtual
    # time (tests/unit/virtual_time.py) exactly so, whatever the machine's load
    with virtual_time.server(FakeBehavior(ttft_per_active_s=0.2)) as srv:
        r = runner.invoke(app, ["slo", str(wl), "--base-url", srv.url, "--slo", "0.5", "--max-load", "8",
                                "--requests-per-point", "8", "--out", str(tmp_path / "slo"),
                                "--json", str(tmp_path / "slo.json")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "slo.json").read_text())
    assert res["best_load"] == 2 and "best users: 2" in r.output
    assert (tmp_path / "slo" / "slo_curve.png").exists()


def test_bench_compare_rejects_a_bad_config_file(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl")
    (tmp_path / "c.yaml").write_text("- {name: a, kv_cache_space: 1}\n")
    r = runner.invoke(app, ["compare", str(wl), "--configs", str(tmp_path / "c.yaml"), "--model", "/m"])
    assert r.exit_code == 2 and "kv_cache_space" in r.output
