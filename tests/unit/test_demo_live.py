"""`kvtier demo` in live history (the default) with fake servers: replies go back into the prompts, the live
ideal comes from the prompts sent, the work figures are reported, and the lighter load point runs."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.client.replay import read_records
from kvtier.demo import companion
from kvtier.demo.calibrate import Calibration, fit_profile
from kvtier.demo.common import DemoOptions, ModelFacts
from kvtier.demo.live import REPLY_CAP_FACTOR, engine_size, replay_options
from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer
from tests.unit.workload_fakes import WordTokenizer

FAST = Calibration(profile=fit_profile([(256, 0.01), (1024, 0.04)]), startup_s=0.1, dtype="float32")
FACTS = ModelFacts(path=Path("/nonexistent"), kv_bytes_per_token=36_864, max_model_len=8192, dtype="float32")


def _fake_start(seen: dict[str, list]):
    @contextmanager
    def start(spec, log_path, ready_timeout_s=None):
        with FakeOpenAIServer.start(FakeBehavior(tagged_replies=True)) as srv:
            seen[spec.name] = srv.state.requests
            yield SimpleNamespace(base_url=srv.url)
    return start


def test_live_demo_sends_replies_back_and_reports_the_ideal_of_what_it_sent(tmp_path):
    base = dataclasses.replace(companion.QUICK, min_bound_s=60.0, think_time_scale=0.0)
    seen: dict[str, list] = {}
    figures = companion.run(base, tmp_path, FACTS, DemoOptions(quick=True, users=2, conversations=3, light_users=1),
                            calibration=FAST, tokenizer=WordTokenizer(), start_server=_fake_start(seen))
    assert figures["history"] == "live" and figures["complete"] is True and figures["problems"] == []
    # later turns carry what that server generated, never the workload's assistant text
    for name, reqs in seen.items():
        later = [r for r in reqs if sum(m["role"] == "assistant" for m in r.body["messages"]) > 0]
        assert later, name
        for r in later:
            replies = [m["content"] for m in r.body["messages"] if m["role"] == "assistant"]
            assert replies[-1].startswith("r"), (name, replies[-1][:40])
        # each reply is generated at the workload reply's own length (no max_tokens override)
        assert len({r.body["max_tokens"] for r in reqs}) > 1
    recs = read_records(tmp_path / "kvtier-ram-ssd" / "requests.jsonl")
    assert {r.history for r in recs} == {"live"}
    # the live ideal is computed from the prompts sent: replies add reply KV to the ceiling
    c = figures["compared"]["kvtier-ram-ssd"]
    assert c["ideal"]["requests"] == figures["planned_requests"]
    assert figures["ideal_hit_rate"] == c["ideal"]["ideal_hit_rate_with_replies"] >= figures["ideal_hit_rate_prompts"]
    for k in ("output_tokens_per_s", "computed_tokens_per_request", "ttft_spread_s", "by_prompt_length"):
        assert c[k] is not None, k
    report = (tmp_path / "report.md").read_text()
    assert "computed (prompt − cached) / request" in report and "spread p90−p10" in report
    # the lighter load point: the same three configurations at 1 user, in users1/, in the report and the JSON
    lp = figures["light_point"]
    assert lp["users"] == 1 and set(lp["requests"]) == {"vanilla", "kvtier-ram", "kvtier-ram-ssd"}
    assert lp["complete"] is True and lp["size"]["concurrency"] == 1
    assert "The same experiment at 1 users" in report and (tmp_path / "users1" / "report.md").is_file()
    assert json.loads((tmp_path / "demo.json").read_text())["light_point"]["users"] == 1


def test_workload_history_keeps_the_old_experiment():
    size = companion.QUICK
    w = replay_options(engine_size(size, "workload"), "workload", 100.0)
    assert w.history == "workload" and dict(w.client.extra_body) == {"max_tokens": size.max_tokens}
    live_size = engine_size(size, "live")
    live = replay_options(live_size, "live", 100.0)
    assert live.history == "live" and live.client.extra_body == ()
    assert live_size.max_tokens == REPLY_CAP_FACTOR * size.assistant_tokens    # the engine leaves room for replies


def test_quick_has_no_light_point_unless_asked():
    assert companion.light_users(DemoOptions(quick=True)) == 0
    assert companion.light_users(DemoOptions(quick=False)) == 6
    assert companion.light_users(DemoOptions(quick=False, light_users=0)) == 0


def test_returning_turns_bound_uses_load_rate_and_new_tokens():
    from kvtier.client.stream import RequestRecord
    from kvtier.demo.live import returning_turns

    profile = fit_profile([(256, 0.5), (1024, 2.0)])          # linear: about 2 ms per token
    recs = [RequestRecord(conversation_id="c", turn=0, api="chat", start_s=0.0, ttft_s=1.0, prompt_tokens=300,
                          cached_tokens=0, output_tokens=20),
            RequestRecord(conversation_id="c", turn=1, api="chat", start_s=2.0, ttft_s=0.3, prompt_tokens=380,
                          cached_tokens=256, output_tokens=20)]
    summary = {"server": {"kvtier": {"kvtier_connector_loaded_tokens_total": 1000,
                                     "kvtier_connector_load_seconds_sum": 0.1}}}
    rt = returning_turns(recs, summary, profile)
    assert rt["requests"] == 1 and rt["new_tokens_mean"] == 380 - 300 - 20
    assert rt["bound_mean_s"] == pytest.approx(256 * 1e-4 + profile.seconds(60))
    assert rt["ttft_over_bound"] == pytest.approx(0.3 / rt["bound_mean_s"])
    assert returning_turns(recs[:1], summary, profile) is None
