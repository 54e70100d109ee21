"""`kvtier simulate | plan | calibrate` on the command line: outputs, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from kvtier.commands import sim_cmd
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, write_workload

app = typer.Typer()


@app.callback()
def _group() -> None:
    """A command group (so the first argument names the command)."""


sim_cmd.register(app)
runner = CliRunner()


def make_wl(tmp_path, n=4):
    convs = [Conversation(id=f"c{i}", turns=[Turn(user=f"hello {i} " * 40, max_tokens=4),
                                             Turn(user="and more " * 30, max_tokens=4, think_time_s=1.0)])
             for i in range(n)]
    p = tmp_path / "w.jsonl"
    write_workload(p, WorkloadHeader(name="t"), convs)
    return p


def test_simulate_prints_and_writes_json_and_plots(tmp_path) -> None:
    wl = make_wl(tmp_path)
    r = runner.invoke(app, ["simulate", str(wl), "--ram", "1GiB", "--json", str(tmp_path / "s.json"),
                            "--out", str(tmp_path / "out"), "-c", "2"])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["requests_ok"] == 8 and s["ttft_mean_s"] > 0 and 0 < s["token_hit_rate"] < 1
    assert set(s["tier_hit_rate"]) == {"gpu", "ram", "ssd", "shared"}
    assert (tmp_path / "out" / "ttft_cdf.png").is_file() and (tmp_path / "out" / "summary.json").is_file()
    r = runner.invoke(app, ["simulate", str(wl), "--json", "-"])
    assert r.exit_code == 0 and json.loads(r.output)["requests_ok"] == 8


def test_simulate_reads_raw_mooncake_traces(tmp_path) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 1500, "output_length": 3,
                                     "hash_ids": [0, 1, i + 2]}) + "\n" for i in range(6)))
    r = runner.invoke(app, ["simulate", str(p), "--mode", "trace", "--json", "-"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["requests_ok"] == 6 and s["unit_tokens"] == 512
    assert s["token_hit_rate"] == pytest.approx(5 * 1024 / (6 * 1500))       # hash ids 0, 1 shared


BAD = [
    (["simulate", "MISSING"], "not found"),
    (["simulate", "BADJSON"], "not valid JSON"),
    (["simulate", "WL", "--mode", "sideways"], "--mode"),
    (["simulate", "WL", "--mode", "open"], "rate"),
    (["simulate", "WL", "--ram", "lots"], "--ram"),
    (["simulate", "WL", "--eviction", "fifo"], "--eviction"),
    (["simulate", "WL", "--profile", "BADPROFILE"], "engine.block_size"),
    (["simulate", "WL", "--profile", "BADYAML"], "YAML"),
    (["simulate", "WL", "--profile", "no-such-preset"], "unknown profile"),
    (["simulate", "WL", "--concurrency", "0"], "concurrency"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle) -> None:
    wl = make_wl(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "turns": [ \n')
    (tmp_path / "badprof.yaml").write_text("engine:\n  block_size: -3\n")
    (tmp_path / "badyaml.yaml").write_text("engine: [unclosed\n")
    subst = {"WL": str(wl), "MISSING": str(tmp_path / "nope.jsonl"), "BADJSON": str(tmp_path / "bad.jsonl"),
             "BADPROFILE": str(tmp_path / "badprof.yaml"), "BADYAML": str(tmp_path / "badyaml.yaml")}
    r = runner.invoke(app, [subst.get(a, a) for a in args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
