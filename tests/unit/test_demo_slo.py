"""demo slo: the SLO and document lengths from the calibration, steady-state points with repeats and
their spread, vanilla treated like kvtier, distinct prompts."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.client.stream import RequestRecord
from kvtier.client.slo import mean_in_flight, steady_summary, steady_window
from kvtier.demo import slo as slo_demo
from kvtier.demo.calibrate import Calibration, fit_profile
from kvtier.demo.common import DemoOptions, ModelFacts
from tests.unit.fake_openai_server import FakeBehavior
from tests.unit.virtual_time import virtual_time  # noqa: F401
from tests.unit.workload_fakes import WordTokenizer


def _profile(per_1k_s: float):
    return fit_profile([(256, per_1k_s / 4), (512, per_1k_s / 2), (1024, per_1k_s)])


def test_a_fast_machine_keeps_the_published_2s_slo():
    c = slo_demo.choose_slo(_profile(1.6), slo_demo.DEFAULT)
    assert c.published and c.slo_s == 2.0
    assert c.cold_ttft_s <= 2.0 / slo_demo.DEFAULT.slo_multiple
    assert len(c.doc_tokens) >= 3 and list(c.doc_tokens) == sorted(set(c.doc_tokens))


def test_a_slow_machine_states_a_multiple_of_its_cold_ttft():
    prof = _profile(4.5)                     # 256 tokens + overhead already ~1.4 s cold
    c = slo_demo.choose_slo(prof, slo_demo.DEFAULT)
    assert not c.published and c.doc_tokens[0] == slo_demo.DEFAULT.min_doc_tokens
    assert c.slo_s == pytest.approx(slo_demo.DEFAULT.slo_multiple * prof.seconds(256 + 64), abs=0.01)
    assert "x this machine's single-user cold TTFT" in c.reason
    assert c.doc_tokens == (256, 512, 1024)


def _rec(start: float, e2e: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(conversation_id=f"c{start}", turn=0, api="chat", start_s=start, ttft_s=e2e / 2, e2e_s=e2e,
                         error_kind=None if ok else "timeout")


def test_steady_window_drops_the_opening_burst_and_the_drain():
    # 2 users, each request 1 s: starts 0,0 (burst), 1,1, 2,2, 3,3 (last issued at 3)
    recs = [_rec(t, 1.0) for t in (0, 0, 1, 1, 2, 2, 3, 3)]
    kept, t0, t1 = steady_window(recs, users=2)
    assert (t0, t1) == (1, 3) and sorted(r.start_s for r in kept) == [1, 1, 2, 2]
    assert mean_in_flight(recs, t0, t1) == pytest.approx(2.0)
    s = steady_summary({"requests_failed": 0, "requests_ok": 8}, recs, 2)
    assert s["window_requests"] == 4 and s["in_flight_mean"] == pytest.approx(2.0) and s["ttft_p90_s"] == 0.5


def test_users_in_lockstep_need_three_rounds_for_a_window():
    """Why MIN_STEADY_ROUNDS is 3: with 2 requests per user (the session-5 sizing floor) every user's
    second request goes out in one burst right after the first round, nothing ends before the last
    one is issued, and the point has no measurement (the session-6 SLO run at 6 and 8 users)."""
    from kvtier.client.slo import MIN_STEADY_ROUNDS
    users = 6

    def lockstep(rounds: int) -> list[RequestRecord]:     # equal documents: every request takes 1 s
        return [_rec(r + 0.001 * u, 1.0) for r in range(rounds) for u in range(users)]

    assert steady_window(lockstep(2), users)[0] == []
    assert len(steady_window(lockstep(MIN_STEADY_ROUNDS), users)[0]) == users      # the middle round


def test_steady_state_search_refuses_fewer_requests_per_user_than_a_window_needs():
    from kvtier.client.replay import ReplayError
    from kvtier.client.slo import SloOptions
    with pytest.raises(ReplayError, match="at least 3 requests per user"):
        SloOptions(steady_state=True, min_requests_per_user=2).validate("closed")
    SloOptions(steady_state=True, min_requests_per_user=3).validate("closed")
    SloOptions(steady_state=False, min_requests_per_user=0).validate("closed")


def test_a_fixed_point_without_a_window_reports_no_hit_rate_not_zero():
    empty = {"ttft_p90_s": None, "token_hit_rate": None, "in_flight_mean": 8.0, "requests_failed": 0}
    res = type("R", (), {"to_dict": lambda self: {}, "best_load": 5.0, "capped": False})()
    out = slo_demo._length_result(res, [empty, empty, empty])
    assert out["fixed_p90_s"] is None and out["fixed_hit_rate"] is None
    half = slo_demo._length_result(res, [empty, {**empty, "ttft_p90_s": 1.0, "token_hit_rate": 0.8}, empty])
    assert half["fixed_p90_s"] is None and half["fixed_hit_rate"] == pytest.approx(0.8)


def test_too_few_requests_give_no_statistic():
    s = steady_summary({"requests_failed": 0}, [_rec(0, 1.0), _rec(0, 1.0)], 2)
    assert s["window_requests"] == 0 and s["ttft_p90_s"] is None


def test_measured_prompts_never_repeat_exactly():
    from kvtier.workload.format import Conversation, Turn
    convs = [Conversation(id=f"d{i}", turns=[Turn(user=f"doc {i} question")]) for i in range(3)]
    out = slo_demo.measured_prompts(convs, 8)
    assert len(out) >= 8 and len({c.id for c in out}) == len(out)
    assert len({c.turns[0].user for c in out}) == len(out)


def _fake_start(vt, knee: dict[str, float]):
    @contextmanager
    def start(spec, log_path, ready_timeout_s=None):
        with vt.server(FakeBehavior(ttft_per_active_s=knee[spec.name])) as srv:
            yield SimpleNamespace(base_url=srv.url)
    return start


def test_demo_slo_on_fake_servers_treats_both_sides_the_same(tmp_path, virtual_time):
    """TTFT grows with requests in flight (faster per user on 'kvtier'): both sides get the same search,
    repeats and fixed point at every length, and the ratios come out of it. Virtual time
    (tests/unit/virtual_time.py): every TTFT is exactly the fake's, so the outcome is exact too."""
    size = dataclasses.replace(slo_demo.QUICK, doc_set_tokens=600, max_users=2, fixed_users=2, min_requests=4,
                               questions=4, warm_questions=1, published_slo_s=0.25, min_doc_tokens=64,
                               max_doc_tokens=256)
    cal = Calibration(profile=_profile(0.02), startup_s=0.1, dtype="float32")
    facts = ModelFacts(path=Path("/nonexistent"), kv_bytes_per_token=36_864, max_model_len=8192, dtype="float32")
    knee = {"vanilla": 0.25 / 1.5, "kvtier-ram-ssd": 0.25 / 9}   # vanilla: 1 user; kvtier: 8 (capped at 2)
    figures = slo_demo.run(size, tmp_path, facts, DemoOptions(quick=True), calibration=cal, tokenizer=WordTokenizer(),
                           start_server=_fake_start(virtual_time, knee))
    assert len(figures["by_length"]) == 3
    for row in figures["by_length"]:
        for name in ("vanilla", "kvtier-ram-ssd"):
            r = row[name]
            assert len(r["fixed_p90_values"]) == size.repeats
            assert all(len(p["values"]) == size.repeats and p["spread"] is not None for p in r["slo"]["points"])
            assert r["fixed_in_flight"] > 0.5 * size.fixed_users
        # vanilla: 1 user x 0.167 s fits the 0.25 s SLO, 2 users (0.33 s) do not; kvtier: 2 users x 0.028 s
        # fit, and 2 is the cap; at the fixed 2 users the p90s are 0.33 s vs 0.056 s
        assert (row["vanilla"]["best_users"], row["vanilla"]["capped"]) == (1, False)
        assert (row["kvtier-ram-ssd"]["best_users"], row["kvtier-ram-ssd"]["capped"]) == (2, True)
        assert row["vanilla"]["fixed_p90_s"] == pytest.approx(2 * knee["vanilla"])
        assert row["kvtier-ram-ssd"]["fixed_p90_s"] == pytest.approx(2 * knee["kvtier-ram-ssd"])
        assert row["users_ratio"] == pytest.approx(2.0) and row["p90_ratio"] == pytest.approx(6.0)
    assert (tmp_path / "slo_by_length.png").stat().st_size > 0
