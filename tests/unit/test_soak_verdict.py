"""The soak's verdict (benchmarks/soak/verdict.py) on synthetic samples: the vLLM worker is judged
against a vanilla run of the same workload (at the same minute) plus kvtier's own budgets; every
process must stop growing in the last third; each breach fails the run with a reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "soak"))

from verdict import MIB, SoakBudgets, main, role, slope, summarize  # noqa: E402

OK = {"requests_ok": 100, "requests_failed": 0, "requests_cancelled": 0}
CHUNK = 6 * MIB
B = SoakBudgets(ssd_bytes=100 * MIB, ram_bytes=150 * MIB, fixed_staging_bytes=4 * CHUNK, chunk_bytes=CHUNK,
                staging_max_buffers=8, margin_bytes=128 * MIB, slope_bound_mib_per_min=2.0)
NAMES = {"api": "python -m vllm.entrypoints.openai.api_server", "core": "VLLM::EngineCore", "worker": "VLLM::Worker"}


def _vanilla_worker(i: int) -> int:
    """vLLM's own worker: grows 1,480 -> 1,900 MiB over 20 minutes, then flat (glibc heap)."""
    return (1480 + 21 * min(i, 20)) * MIB


def _run(n=31, worker=lambda i: 1500 * MIB, api=lambda i: 700 * MIB, staging=lambda i: 0, fds=lambda i: 50,
         threads=lambda i: 30, disk=lambda i: 10 * MIB, pid0=100):
    """``n`` samples a minute apart, three processes (pids differ between runs, roles do not)."""
    out = []
    for i in range(n):
        procs = {str(pid0): {"name": NAMES["api"], "rss": api(i), "fds": fds(i), "threads": threads(i)},
                 str(pid0 + 1): {"name": NAMES["core"], "rss": 650 * MIB, "fds": 50, "threads": 17},
                 str(pid0 + 2): {"name": NAMES["worker"], "rss": worker(i), "fds": 87, "threads": 59,
                                 "staging_maps": staging(i)}}
        out.append({"t": 1000.0 + 60.0 * i, "disk_bytes": disk(i), "procs": procs})
    return out


VANILLA = _run(worker=_vanilla_worker, pid0=500)


def _kvtier_worker(extra: int = 0):
    """vanilla's worker + the RAM tier filling over 3 minutes + 2 staging buffers + 80 MiB of kvtier code."""
    return lambda i: _vanilla_worker(i) + 150 * MIB * min(i, 3) // 3 + 2 * CHUNK + 80 * MIB + extra


def test_kvtier_worker_on_top_of_vanillas_own_growth_passes():
    s = summarize(OK, _run(worker=_kvtier_worker(), staging=lambda i: 2), B, reference=VANILLA)
    assert s["passed"], s["why_not"]
    w = s["processes"]["worker"]
    assert w["reference"] == "vanilla run" and w["staging_maps_max"] == 2
    # budget at the worst minute = vanilla's largest RSS so far + RAM + fixed staging + 2 staging buffers + margin
    m = int(w["rss_worst_minute"])
    assert w["rss_budget_at_worst"] == _vanilla_worker(m) + 150 * MIB + 4 * CHUNK + 2 * CHUNK + 128 * MIB


def test_the_same_run_without_a_vanilla_reference_fails():
    # the earlier rule (first sample + budgets) assumed vLLM's own worker is flat
    s = summarize(OK, _run(worker=_kvtier_worker(), staging=lambda i: 2), B)
    assert not s["passed"]
    assert s["processes"]["worker"]["reference"] == "own first sample"
    assert any("RSS of the worker" in w and "over its budget" in w for w in s["why_not"]), s["why_not"]


def test_worker_past_vanilla_plus_kvtiers_budgets_fails():
    over = 4 * CHUNK + 128 * MIB + 10 * MIB       # more than the fixed staging + margin beyond its 80 MiB
    s = summarize(OK, _run(worker=_kvtier_worker(over), staging=lambda i: 2), B, reference=VANILLA)
    assert not s["passed"]
    assert any("RSS of the worker" in w for w in s["why_not"]), s["why_not"]


def test_growth_in_the_last_third_fails_even_within_budget():
    # the first sample's budget would allow +400 MiB; a slow leak from minute 20 on stays far below it
    leak = _run(worker=lambda i: 1500 * MIB + max(0, i - 20) * 3 * MIB)
    s = summarize(OK, leak, B, reference=_run(worker=lambda i: 1500 * MIB))
    assert not s["passed"]
    assert s["processes"]["worker"]["rss_ok"]
    assert any("grows" in w and "last third" in w for w in s["why_not"]), s["why_not"]


def test_vanillas_own_late_growth_still_fails_the_slope_bound():
    # kvtier's soak must be flat at its end whatever vLLM does: the bound is absolute
    grows = lambda i: (1500 + 10 * i) * MIB  # noqa: E731
    s = summarize(OK, _run(worker=grows), B, reference=_run(worker=grows))
    assert not s["passed"] and any("grows" in w for w in s["why_not"])


def test_noise_without_a_trend_passes():
    s = summarize(OK, _run(worker=lambda i: (1600 + (8 if i % 2 else -8)) * MIB), B)
    assert s["passed"], s["why_not"]
    assert abs(s["processes"]["worker"]["rss_slope_last_third_mib_per_min"]) < 2


def test_other_processes_get_no_ram_budget():
    # the API server holds no kvtier RAM tier: growing by the RAM budget is over its budget
    s = summarize(OK, _run(api=lambda i: 700 * MIB + (150 * MIB if i >= 5 else 0)), B,
                  reference=_run(pid0=900))
    assert not s["passed"]
    assert any("RSS of the api_server" in w for w in s["why_not"]), s["why_not"]


def test_staging_buffers_beyond_the_queue_depth_fail():
    s = summarize(OK, _run(staging=lambda i: 9), B, reference=_run())
    assert not s["passed"] and any("staging buffers" in w for w in s["why_not"]), s["why_not"]


def test_a_vanilla_run_gets_no_kvtier_budget():
    van = SoakBudgets(**{**B.__dict__, "kvtier": False})
    s = summarize(OK, _run(worker=lambda i: 1500 * MIB + (200 * MIB if i >= 5 else 0)), van)
    assert not s["passed"] and any("RSS of the worker" in w for w in s["why_not"])


def test_too_short_a_run_cannot_pass():
    s = summarize(OK, _run(n=4), B)
    assert not s["passed"] and any("too few samples" in w for w in s["why_not"]), s["why_not"]


def test_each_other_breach_fails_with_a_reason():
    cases = {"SSD": _run(disk=lambda i: 150 * MIB if i == 4 else 10 * MIB),
             "grew": _run(fds=lambda i: 50 + 5 * i)}
    for word, samples in cases.items():
        s = summarize(OK, samples, B)
        assert not s["passed"], word
        assert any(word in w for w in s["why_not"]), (word, s["why_not"])
    s = summarize(OK, _run(threads=lambda i: 30 + (20 if i > 20 else 0)), B)
    assert any("threads" in w and "grew" in w for w in s["why_not"]), s["why_not"]


def test_failed_or_cancelled_requests_fail():
    for replay in ({**OK, "requests_failed": 1}, {**OK, "requests_cancelled": 2}, {**OK, "requests_ok": 0}):
        s = summarize(replay, _run(), B)
        assert not s["passed"] and any("requests" in w for w in s["why_not"]), s["why_not"]


def test_threads_started_on_the_first_requests_are_not_growth():
    # thread pools start with the first requests (sample 1): the baseline is the warmed-up sample 2
    s = summarize(OK, _run(threads=lambda i: 10 if i < 1 else 30), B)
    assert s["passed"], s["why_not"]


def test_roles_and_slope():
    assert [role(n) for n in (*NAMES.values(), "python -B -c")] == ["api_server", "engine_core", "worker", "other"]
    assert abs(slope([(0, 1.0), (1, 3.0), (2, 5.0)]) - 2.0) < 1e-9
    assert slope([(1, 1.0)]) is None


def test_cli_rejudges_a_folder_and_rejects_a_missing_one(tmp_path, capsys):
    run, van = tmp_path / "run", tmp_path / "van"
    for folder, samples in ((run, _run(worker=_kvtier_worker(), staging=lambda i: 2)), (van, VANILLA)):
        folder.mkdir()
        (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        (folder / "summary.json").write_text(json.dumps({
            **OK, "vanilla": folder == van, "chunk_payload_bytes": CHUNK, "fixed_staging_bytes": 4 * CHUNK,
            "staging_max_buffers": 8, "budgets": {"ssd_budget_bytes": 100 * MIB, "ram_budget_bytes": 150 * MIB,
                                                  "kv_bytes_per_token": 1}}))
    assert main([str(run), "--vanilla-ref", str(van), "--write", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["passed"]
    assert main([str(run)]) == 1                   # without the reference: vLLM's own growth is charged
    capsys.readouterr()
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_open_files_that_go_up_and_down_with_requests_are_not_growth():
    # the API server's client sockets: 30-43 in both halves (a kvtier soak: 35 at the
    # warm-up sample, 41 late); judged against the first half's largest value, not one sample
    fds = [30, 36, 35, 36, 40, 43, 39, 38, 35, 34, 40, 35, 35, 34, 39, 37, 37, 38, 38, 36, 38, 35, 40, 41, 41, 41,
           39, 36, 31, 33, 37]
    s = summarize(OK, _run(fds=lambda i: fds[i]), B)
    assert s["passed"], s["why_not"]
