"""``kvtier demo cluster``: bad input is a one-line error before anything starts; the run plan."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from kvtier.commands import demo_cmd
from kvtier.demo.cluster import ClusterOptions
from kvtier.demo.common import DemoError


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas"),
    (["--routing", "random"], "unknown value(s) random"),
    (["--configs", "local,remote"], "unknown value(s) remote"),
    (["--workload", "poetry"], "unknown --workload"),
    (["--shared", "nfs"], "unknown --shared"),
    (["--configs", "vanilla", "--routing", "kv-aware"], "nothing to run"),
])
def test_bad_input_is_a_usage_error(args, message, monkeypatch):
    monkeypatch.setattr("kvtier.commands.demo_cmd._run_cluster",
                        lambda *a, **k: pytest.fail("the demo must not start on bad input"))
    app = typer.Typer()
    demo_cmd.register(app)
    res = CliRunner().invoke(app, ["demo", "cluster", *args], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 2
    assert message in " ".join(res.output.split())


def test_runs_follow_configs_and_routing():
    assert ClusterOptions().runs() == [("vanilla", "roundrobin"), ("vanilla", "sticky"), ("local", "roundrobin"),
                                       ("local", "sticky"), ("local", "kv-aware"), ("shared", "roundrobin"),
                                       ("shared", "sticky"), ("shared", "kv-aware")]
    assert ClusterOptions(quick=True).runs() == [("local", "roundrobin"), ("local", "sticky"), ("local", "kv-aware"),
                                                 ("shared", "roundrobin"), ("shared", "sticky"), ("shared", "kv-aware")]
    assert ClusterOptions(configs=("shared", "vanilla"), routing=("kv-aware", "sticky")).runs() == [
        ("vanilla", "sticky"), ("shared", "sticky"), ("shared", "kv-aware")]


def test_validate_names_the_problem():
    with pytest.raises(DemoError, match="--replicas must be >= 1"):
        ClusterOptions(replicas=0).validate()
    with pytest.raises(DemoError, match="unknown --history"):
        ClusterOptions(history="old").validate()
