"""benchmarks/cluster/validate_sim.py on a synthetic measured `kvtier demo cluster --json` file: every
configuration x routing is simulated with the run's capacities and load, and the errors against the
measured figures are computed, judged against the targets and written (Markdown + JSON)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvtier.workload.companion import CompanionSpec, generate_companion
from kvtier.workload.format import write_workload

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("validate_sim", ROOT / "benchmarks" / "cluster" / "validate_sim.py")
vs = importlib.util.module_from_spec(_spec)
sys.modules["validate_sim"] = vs
_spec.loader.exec_module(vs)

CAL = {"profile": {"points": [[256, 0.5], [512, 1.05], [1024, 2.2]], "a": 0.01, "b": 0.002, "c": 2e-7,
                   "elapsed_s": 10.0, "decode_points": [[1, 0.05], [4, 0.08]]}, "startup_s": 30.0, "dtype": "float32"}


def measured(tmp: Path, runs_from=None) -> Path:
    spec = CompanionSpec(conversations=8, turns_mean=3, turns_max=5, personas=2, system_tokens=300, user_tokens=30,
                         assistant_tokens=40, max_prompt_tokens=2000, resume_fraction=0.3, think_time_s=2.0, seed=3)
    write_workload(tmp / "workload.jsonl", *generate_companion(spec))
    runs = []
    for cfg in ("vanilla", "local", "shared"):
        for routing in ("roundrobin", "sticky", "kv-aware"):
            runs.append({"config": cfg, "routing": routing, "token_hit_rate": 0.3, "ideal_hit_rate": 0.6,
                         "ttft_mean_s": 1.0, "ttft_p50_s": 0.9, "ttft_p90_s": 2.0, "requests": 20,
                         "per_replica": [{"requests": 10}, {"requests": 10}],
                         "tier_tokens": {"gpu": 100, "ram": 100, "ssd": 0, "shared": 200},
                         "computed_tokens_per_request": 500.0,
                         "capacities": {"kv_cache_tokens": 4096, "ram_bytes": 200 * 2**20, "ssd_bytes": 2**30,
                                        "shared_bytes": 2**30},
                         "load": {"mode": "closed", "concurrency": 3, "think_time_scale": 0.5}})
    if runs_from is not None:
        for r, got in zip(runs, runs_from):
            r.update(got)
    p = tmp / "cluster.json"
    # the demo's document: the calibration's path (gone) and its inline copy, the capacities' KV bytes
    p.write_text(json.dumps({"machine": {"cpu": "test CPU", "cpus": 2}, "replicas": 2, "workload": "workload.jsonl",
                             "calibration": str(tmp / "gone" / "calibration.json"), "prefill_profile": CAL,
                             "dtype": "float32", "history": "workload", "chunk_tokens": 128,
                             "capacities": {"kv_bytes_per_token": 46080}, "runs": runs}))
    return p


def run(p: Path, out: Path) -> dict:
    assert vs.main([str(p), "--out", str(out), "--tokenizer", "approx"]) == 0
    assert (out / "validation.md").is_file()
    return json.loads((out / "validation.json").read_text())


def test_errors_are_simulated_minus_measured_and_judged_against_the_targets(tmp_path) -> None:
    rep = run(measured(tmp_path), tmp_path / "v1")
    assert len(rep["rows"]) == 9 and rep["knobs"]["kv_bytes_per_token"] == 46080
    assert rep["knobs"]["sources"]["kv_bytes_per_token"] == "measured file"
    assert rep["knobs"]["chunk_size"] == 128 and rep["knobs"]["sources"]["block_size"] == "default"
    sims = [r["simulated"] for r in rep["rows"]]
    by = {(r["config"], r["routing"]): r for r in rep["rows"]}
    assert by[("vanilla", "roundrobin")]["simulated"]["tier_hit_rate"]["ram"] == 0
    assert by[("shared", "roundrobin")]["simulated"]["tier_hit_rate"]["shared"] > 0
    assert all(sum(s["per_replica_requests"]) == s["requests"] for s in sims)
    # measured tier shares: the tier's tokens over all hit tokens, times the measured hit rate
    assert rep["rows"][0]["measured"]["tier_hit_rate"] == pytest.approx({"gpu": 0.075, "ram": 0.075, "ssd": 0.0,
                                                                         "shared": 0.15})
    assert 0 < rep["ideal_hit_rate_simulated_trace"] < 1
    for r in rep["rows"]:
        s = r["simulated"]
        assert r["hit_rate_error_points"] == pytest.approx(s["token_hit_rate"] - 0.3)
        assert r["ttft_mean_error"] == pytest.approx(s["ttft_mean_s"] / 1.0 - 1)
    # measured = simulated moved by less than the targets: every row passes; by more: every row fails
    near = [{"token_hit_rate": s["token_hit_rate"] + 0.04, "ttft_mean_s": s["ttft_mean_s"] * 1.1} for s in sims]
    rep2 = run(measured(tmp_path, near), tmp_path / "v2")
    assert rep2["all_ok"] and all(r["hit_ok"] and r["ttft_ok"] for r in rep2["rows"])
    assert [r["simulated"] for r in rep2["rows"]] == sims          # the simulation does not depend on the figures
    far = [{"token_hit_rate": s["token_hit_rate"] - 0.06, "ttft_mean_s": s["ttft_mean_s"] * 0.8} for s in sims]
    rep3 = run(measured(tmp_path, far), tmp_path / "v3")
    assert not rep3["all_ok"] and not any(r["hit_ok"] or r["ttft_ok"] for r in rep3["rows"])
    md = (tmp_path / "v3" / "validation.md").read_text()
    assert "test CPU" in md and md.count("| no |") == 9


def test_the_engine_comes_from_the_calibration(tmp_path) -> None:
    pp = vs.calibration_of(measured(tmp_path), {"calibration": CAL})
    assert vs.calibration_of(tmp_path / "x.json", {"prefill_profile": CAL}) == pp
    k = vs.Knobs(46080, 128, 2048, 256, 1e10, 3e9, 1e9, {})
    e = vs.engine_from(pp, 4096, k)
    assert e.decode_seq_s == pytest.approx(0.01) and e.step_overhead_s == pytest.approx(0.04)
    assert e.prefill_attn_s == pytest.approx(4e-7) and e.prefill_token_s == pytest.approx(0.002 - 2e-7)
    assert e.request_overhead_s == 0.0                    # a < one step: no extra fixed cost


@pytest.mark.parametrize("drop, msg", [("runs", "no 'runs'"), ("workload", "no 'workload'")])
def test_a_bad_measured_file_is_a_one_line_error(tmp_path, capsys, drop, msg) -> None:
    p = measured(tmp_path)
    d = json.loads(p.read_text())
    del d[drop]
    p.write_text(json.dumps(d))
    assert vs.main([str(p), "--out", str(tmp_path / "v"), "--tokenizer", "approx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]
