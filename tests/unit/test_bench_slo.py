"""SLO search: the doubling + bisection logic, and a real replay against a fake server with a knee."""

from __future__ import annotations

import json

import pytest

from kvtier.client.replay import ReplayError, ReplayOptions, load_conversations
from kvtier.client.slo import SloOptions, SloResult, run_slo, search
from tests.unit.fake_openai_server import FakeBehavior
from tests.unit.test_bench_replay import make_workload
from tests.unit.virtual_time import virtual_time  # noqa: F401


def synthetic(per_load: float, fail_above: float | None = None):
    calls = []

    def evaluate(load, repeat):
        calls.append((load, repeat))
        failed = 1 if fail_above is not None and load > fail_above else 0
        return {"ttft_p90_s": per_load * load, "requests_failed": failed, "requests_ok": 10}, []
    return evaluate, calls


def test_closed_search_doubles_then_bisects_to_the_knee():
    evaluate, calls = synthetic(0.1)
    res = search(evaluate, "closed", SloOptions(slo_s=0.55, repeats=2))
    assert res.best_load == 5 and not res.capped
    assert [p.load for p in res.points] == [1, 2, 4, 5, 6, 8]
    assert all(p.passed == (p.load <= 5) for p in res.points)
    assert len(calls) == 2 * len(res.points)  # each point repeated, none measured twice


def test_open_search_bisects_rates_to_tolerance():
    evaluate, _ = synthetic(0.1)
    res = search(evaluate, "open", SloOptions(slo_s=0.55, start=0.5, max_load=64, rate_tolerance=0.05))
    assert 5.0 <= res.best_load <= 5.5
    failing = min(p.load for p in res.points if not p.passed)
    assert (failing - res.best_load) / res.best_load <= 0.05


def test_a_point_with_a_failed_request_fails():
    evaluate, _ = synthetic(0.01, fail_above=3)
    res = search(evaluate, "closed", SloOptions(slo_s=1.0))
    assert res.best_load == 3


def test_first_point_failing_and_cap_are_reported():
    evaluate, _ = synthetic(1.0)
    assert search(evaluate, "closed", SloOptions(slo_s=0.5)).best_load is None
    evaluate, _ = synthetic(0.001)
    res = search(evaluate, "closed", SloOptions(slo_s=0.5, max_load=12))
    assert res.best_load == 12 and res.capped and [p.load for p in res.points] == [1, 2, 4, 8, 12]


def test_bad_search_options():
    evaluate, _ = synthetic(0.1)
    with pytest.raises(ReplayError):
        search(evaluate, "closed", SloOptions(start=1.5))
    with pytest.raises(ReplayError):
        search(evaluate, "closed", SloOptions(statistic="token_hit_rate"))


def test_slo_search_finds_the_knee_of_a_fake_server(tmp_path, virtual_time):
    # TTFT = 0.15 s x in-flight requests; with N closed-loop users at most N are in flight,
    # so N=5 gives <= 0.75 s and N=6 gives 0.9 s once all six are in flight: the knee under 0.825 s
    # is 5. Virtual time (tests/unit/virtual_time.py): those TTFTs are exact, whatever the load.
    wl = make_workload(tmp_path / "w.jsonl", n_conv=200, n_turns=1)
    convs, _ = load_conversations(wl, False)
    with virtual_time.server(FakeBehavior(ttft_per_active_s=0.15)) as srv:
        res = run_slo(convs, srv.url, ReplayOptions(mode="closed", progress=False),
                      SloOptions(slo_s=0.825, requests_per_point=12), tmp_path / "slo")
    assert res.best_load == 5, [(p.load, p.value) for p in res.points]
    assert [p.load for p in res.points] == [1, 2, 4, 5, 6, 8]     # doubling, then bisection
    by_load = {p.load: p.value for p in res.points}
    assert by_load[1] == pytest.approx(0.15) and by_load[5] == pytest.approx(0.75)   # p90 = 0.15 x N
    assert by_load[6] == pytest.approx(0.9) and by_load[8] == pytest.approx(1.2)
    assert SloResult.from_dict(json.loads((tmp_path / "slo" / "slo.json").read_text())).best_load == 5
    assert (tmp_path / "slo" / "points" / "load-5-r0.jsonl").exists()


def test_slo_search_rejects_trace_mode(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl")
    convs, _ = load_conversations(wl, False)
    with pytest.raises(ReplayError, match="closed"):
        run_slo(convs, "http://127.0.0.1:1", ReplayOptions(mode="trace"), SloOptions())
