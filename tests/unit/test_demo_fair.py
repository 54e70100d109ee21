"""Time bounds never change what is compared: a configuration cut short by its bound makes the
comparison partial, and every configuration is then summarized on exactly the same requests."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.client.stream import RequestRecord
from kvtier.demo import companion
from kvtier.demo.calibrate import Calibration, fit_profile
from kvtier.demo.common import DemoOptions, ModelFacts
from kvtier.demo.fair import same_requests
from tests.unit.fake_openai_server import FakeBehavior
from tests.unit.virtual_time import virtual_time  # noqa: F401
from tests.unit.workload_fakes import WordTokenizer


def _rec(conv: str, turn: int, ttft: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(conversation_id=conv, turn=turn, api="chat", start_s=float(turn), ttft_s=ttft,
                         prompt_tokens=100, cached_tokens=50, error_kind=None if ok else "timeout")


def test_complete_runs_keep_their_full_summaries():
    recs = {"a": [_rec("c0", 0, 1.0), _rec("c0", 1, 2.0)], "b": [_rec("c0", 1, 0.5), _rec("c0", 0, 0.5)]}
    full = {"a": {"requests_ok": 2, "marker": "a"}, "b": {"requests_ok": 2, "marker": "b"}}
    same = same_requests(recs, full, planned=2)
    assert same.complete and same.common == 2
    assert same.summaries == full
    assert same.to_dict()["requests"]["a"] == {"planned": 2, "ok": 2, "failed": 0, "cancelled": 0,
                                               "stopped_reason": None, "complete": True}


def test_a_short_run_restricts_every_configuration_to_the_common_requests():
    slow = [_rec("c0", 0, 4.0), _rec("c1", 0, 4.0)]                       # cut short after 2 of 4
    fast = [_rec("c0", 0, 1.0), _rec("c0", 1, 0.1), _rec("c1", 0, 1.0), _rec("c1", 1, 0.1)]
    full = {"slow": {"requests_ok": 2, "duration_s": 10.0, "stopped_reason": "duration reached"},
            "fast": {"requests_ok": 4, "duration_s": 5.0, "stopped_reason": "workload exhausted"}}
    same = same_requests({"slow": slow, "fast": fast}, full, planned=4)
    assert not same.complete and same.common == 2 and same.incomplete() == ["slow"]
    for name in ("slow", "fast"):
        s = same.summaries[name]
        assert s["requests_ok"] == 2 and s["partial"] is True
    # the fast configuration's easy later turns (0.1 s) are not in its compared mean
    assert same.summaries["fast"]["ttft_mean_s"] == 1.0
    assert same.summaries["fast"]["requests_ok_full_run"] == 4
    d = same.to_dict()
    assert d["complete"] is False and d["requests"]["slow"]["ok"] == 2 and d["requests"]["fast"]["ok"] == 4


def test_a_failed_request_is_not_common():
    a = [_rec("c0", 0, 1.0), _rec("c0", 1, 1.0, ok=False)]
    b = [_rec("c0", 0, 1.0), _rec("c0", 1, 1.0)]
    same = same_requests({"a": a, "b": b}, {"a": {"duration_s": 1}, "b": {"duration_s": 1}}, planned=2)
    assert not same.complete and same.common == 1 and same.counts["a"].failed == 1


def _fake_start(vt, delays: dict[str, float], started: list[str]):
    """Fake servers in virtual time (tests/unit/virtual_time.py): the bound and the delays are exact."""
    @contextmanager
    def start(spec, log_path, ready_timeout_s=None):
        started.append(spec.name)
        with vt.server(FakeBehavior(first_token_delay_s=delays[spec.name])) as srv:
            yield SimpleNamespace(base_url=srv.url)
    return start


def test_demo_with_a_slow_server_is_partial_and_compares_the_same_requests(tmp_path, virtual_time):
    """A fake 'vanilla' that answers slowly hits the time bound: the demo says partial, and every
    configuration's figures are on exactly the requests all of them served."""
    fast = Calibration(profile=fit_profile([(256, 0.01), (1024, 0.04)]), startup_s=0.1, dtype="float32")
    base = dataclasses.replace(companion.QUICK, min_bound_s=2.0, bound_factor=0.0, max_tokens=2,
                               think_time_scale=0.0)
    facts = ModelFacts(path=Path("/nonexistent"), kv_bytes_per_token=36_864, max_model_len=8192, dtype="float32")
    started: list[str] = []
    figures = companion.run(base, tmp_path, facts, DemoOptions(quick=True, users=2, conversations=4,
                                                               history="workload"),
                            calibration=fast, tokenizer=WordTokenizer(),
                            start_server=_fake_start(virtual_time, {"vanilla": 0.5, "kvtier-ram": 0.01, "kvtier-ram-ssd": 0.01},
                                                     started))
    assert started == ["vanilla", "kvtier-ram", "kvtier-ram-ssd"]
    assert figures["complete"] is False
    counts = figures["requests"]
    planned = figures["planned_requests"]
    assert counts["vanilla"]["ok"] < planned and counts["vanilla"]["stopped_reason"] == "duration reached"
    assert counts["kvtier-ram"]["ok"] == planned and counts["kvtier-ram-ssd"]["ok"] == planned
    assert 0 < figures["compared_requests"] == counts["vanilla"]["ok"]
    # every configuration's figures are on exactly those requests
    assert {c["requests_ok"] for c in figures["compared"].values()} == {figures["compared_requests"]}
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["complete"] is False and saved["requests"] == counts
    assert "PARTIAL" in (tmp_path / "report.md").read_text()
    assert figures["speedup_mean_ttft"] == pytest.approx(50.0)   # 0.5 s vs 0.01 s first TTFT, same requests
    assert figures["problems"] == []


def test_demo_on_fast_servers_is_complete(tmp_path, virtual_time):
    fast = Calibration(profile=fit_profile([(256, 0.01), (1024, 0.04)]), startup_s=0.1, dtype="float32")
    base = dataclasses.replace(companion.QUICK, min_bound_s=30.0, max_tokens=2)
    facts = ModelFacts(path=Path("/nonexistent"), kv_bytes_per_token=36_864, max_model_len=8192, dtype="float32")
    figures = companion.run(base, tmp_path, facts, DemoOptions(quick=True, users=2, conversations=3),
                            calibration=fast, tokenizer=WordTokenizer(),
                            start_server=_fake_start(virtual_time, {n: 0.001 for n in ("vanilla", "kvtier-ram", "kvtier-ram-ssd")}, []))
    assert figures["complete"] is True
    assert {c["ok"] for c in figures["requests"].values()} == {figures["planned_requests"]}
