"""``kvtier bench ttft --slow-tier --layerwise``: both runs in one invocation, one report (no engine:
the two runs are replaced by fakes that record what they were asked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvtier.bench import ttft_layerwise, ttft_slow
from kvtier.commands import ttft_cmd


class _Report:
    def __init__(self, violations: list[str], crashes: dict | None = None) -> None:
        self.violations, self.crashes = violations, crashes or {}


@pytest.fixture
def runs(monkeypatch, tmp_path: Path) -> dict:
    calls: dict = {"bad": {}}

    def fake(name: str):
        def run(model, workdir, lengths, *a, **kw):
            calls[name] = {"workdir": Path(workdir), "lengths": lengths, "repeats": kw["repeats"]}
            return _Report(calls["bad"].get(name, []))
        return run
    monkeypatch.setattr(ttft_slow, "run_slow_tier", fake("slow_tier"))
    monkeypatch.setattr(ttft_layerwise, "run_layerwise", fake("layerwise"))
    monkeypatch.setattr(ttft_slow, "report_markdown", lambda r: "# slow tier table")
    monkeypatch.setattr(ttft_slow, "report_json", lambda r: {"kind": "slow"})
    monkeypatch.setattr(ttft_layerwise, "report_markdown", lambda r: "# layerwise table")
    monkeypatch.setattr(ttft_layerwise, "report_json", lambda r: {"kind": "layerwise"})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return calls


def _invoke(tmp_path: Path, *args: str):
    app = typer.Typer()
    ttft_cmd.register(app)
    app.command("other")(lambda: None)          # a group: the command is invoked by its name
    return CliRunner().invoke(app, ["ttft", "--model", str(tmp_path / "model"), "--workdir", str(tmp_path / "w"),
                                    "--dtype", "float32", *args])


def test_both_runs_in_one_invocation_with_one_report(runs: dict, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = _invoke(tmp_path, "--slow-tier", "--layerwise", "--lengths", "7424", "--repeats", "3", "--json", str(out),
                  "--md", str(tmp_path / "r.md"))
    assert res.exit_code == 0, res.output
    assert runs["slow_tier"] == {"workdir": tmp_path / "w" / "slow-tier", "lengths": [7424], "repeats": 3}
    assert runs["layerwise"] == {"workdir": tmp_path / "w" / "layerwise", "lengths": [7424], "repeats": 3}
    assert json.loads(out.read_text()) == {"slow_tier": {"kind": "slow"}, "layerwise": {"kind": "layerwise"}}
    assert (tmp_path / "r.md").read_text() == "# slow tier table\n# layerwise table"


def test_one_run_alone_keeps_its_own_report_and_workdir(runs: dict, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert _invoke(tmp_path, "--slow-tier", "--json", str(out)).exit_code == 0
    assert runs["slow_tier"]["workdir"] == tmp_path / "w" and runs["slow_tier"]["lengths"] == [1024]
    assert "layerwise" not in runs and json.loads(out.read_text()) == {"kind": "slow"}


def test_a_violation_in_either_run_fails_the_invocation_after_both_ran(runs: dict, tmp_path: Path) -> None:
    runs["bad"]["slow_tier"] = ["pays-off 7424: slower than recompute"]
    res = _invoke(tmp_path, "--slow-tier", "--layerwise", "--lengths", "2048")
    assert res.exit_code == 1 and "layerwise" in runs
    assert "pays-off 7424: slower than recompute" in " ".join(res.output.split())


def test_both_need_whole_chunks_and_one_repeat_count(runs: dict, tmp_path: Path) -> None:
    res = _invoke(tmp_path, "--slow-tier", "--layerwise", "--lengths", "8000")
    assert res.exit_code == 2 and "multiples of the 256-token chunk" in " ".join(res.output.replace("│", " ").split())
    res = _invoke(tmp_path, "--slow-tier", "--layerwise", "--lengths", "1024,2048", "--repeats", "3,2")
    assert res.exit_code == 2 and "one --repeats count" in " ".join(res.output.replace("│", " ").split())
    assert "slow_tier" not in runs and "layerwise" not in runs
