"""Replay ordering, load modes, bounds and failure handling, against the fake server.

Tests whose assertions are about time (think times, the open loop's duration, trace arrivals, the
drain timeout, overlap of users) run in virtual time (tests/unit/virtual_time.py): the fake
server is reached in-process and the clock moves only when every task waits, so the bounds are
exact instead of margins a loaded machine can break. The failure tests keep a real server on a
real socket (HTTP 500, a dropped connection, a server that goes away, nothing listening)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.client.replay import ReplayError, ReplayOptions, read_records, run_replay
from kvtier.ports import free_port
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, write_workload
from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer
from tests.unit.virtual_time import virtual_time  # noqa: F401


def make_workload(path: Path, n_conv: int = 4, n_turns: int = 3, think: float = 0.0,
                  user_fn=lambda i, k: f"conv {i} question {k} " + "word " * 20, arrival_gap: float = 0.0) -> Path:
    convs = [Conversation(id=f"c{i}", arrival_s=i * arrival_gap, system=f"system prompt {i}",
                          turns=[Turn(user=user_fn(i, k), assistant=f"WORKLOAD-ASSISTANT-{i}-{k}",
                                      think_time_s=think if k else 0.0, max_tokens=4) for k in range(n_turns)])
             for i in range(n_conv)]
    write_workload(path, WorkloadHeader(name="test"), convs)
    return path


def opts(**kw) -> ReplayOptions:
    kw.setdefault("progress", False)
    return ReplayOptions(**kw)


def by_conv(requests):
    out: dict[str, list] = {}
    for r in requests:
        if "messages" in r.body:
            cid = r.body["messages"][0]["content"].split()[-1]
            out.setdefault(cid, []).append(r)
    return out


def test_closed_loop_orders_turns_and_uses_workload_history(tmp_path, virtual_time):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=4, n_turns=3, think=0.15)
    with virtual_time.server(FakeBehavior(first_token_delay_s=0.05, token_delay_s=0.01)) as srv:
        res = run_replay(wl, srv.url, opts(mode="closed", concurrency=2), tmp_path / "out")
        reqs = list(srv.state.requests)
    assert res.summary["requests_ok"] == 12 and res.summary["requests_failed"] == 0
    assert res.stopped_reason == "workload exhausted"
    convs = by_conv(reqs)
    assert len(convs) == 4
    for cid, rs in convs.items():
        assert len(rs) == 3
        for k in range(1, 3):
            prev, cur = rs[k - 1], rs[k]
            # exactly: turn k+1 is sent when turn k ended + the think time, never before
            assert cur.arrival == pytest.approx(prev.end + 0.15), "turn k+1 not sent at turn k's end + think time"
            msgs = cur.body["messages"]
            assert msgs[-1]["content"].startswith(f"conv {cid} question {k}")
            assert [m["content"] for m in msgs if m["role"] == "assistant"] == \
                [f"WORKLOAD-ASSISTANT-{cid}-{j}" for j in range(k)]
    # at most 2 conversations in flight at once (closed loop with 2 users)
    assert max(r.active_at_arrival for r in reqs) <= 2
    assert max(r.active_at_arrival for r in reqs) == 2, "the two users should overlap"
    # raw records on disk match the summary
    recs = read_records(res.records_path)
    assert len(recs) == 12 and all(r.ok for r in recs)
    summary = json.loads(res.summary_path.read_text())
    for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "token_hit_rate", "requests_ok",
                "requests_failed"):
        assert key in summary
    assert summary["token_hit_rate"] > 0.3  # later turns extend earlier prompts
    assert summary["first_turn"]["requests"] == 4 and summary["later_turns"]["requests"] == 8
    assert summary["first_turn"]["token_hit_rate"] < summary["later_turns"]["token_hit_rate"]
    assert summary["server"]["prefix_cache_hit_rate"] == pytest.approx(summary["token_hit_rate"])
    # kvtier_* series on the API server's /metrics are never measurements (that process does not run the
    # connector): left out unless scraped from kvtier's own endpoints (extra_metrics_urls)
    assert summary["server"]["kvtier"] == {}
    assert summary["server"]["ttft_count"] == 12


def test_max_requests_bounds_a_closed_run(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=10, n_turns=3)
    with FakeOpenAIServer.start() as srv:
        res = run_replay(wl, srv.url, opts(concurrency=3, max_requests=7), tmp_path / "out")
        n_server = len(srv.state.requests)
    assert res.summary["requests_total"] == 7 == n_server
    assert res.stopped_reason == "max_requests reached"


def test_open_loop_poisson_is_bounded_by_duration(tmp_path, virtual_time):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=200, n_turns=2, think=0.05)
    with virtual_time.server(FakeBehavior(first_token_delay_s=0.02, token_delay_s=0.001)) as srv:
        res = run_replay(wl, srv.url, opts(mode="open", rate=20.0, duration_s=1.0), tmp_path / "out")
    s = res.summary
    assert res.stopped_reason == "duration reached"
    # in-flight requests (each 0.02 s + 3 x 0.001 s) finish after the deadline; nothing is sent after it
    assert 1.0 <= s["duration_s"] <= 1.0 + 0.023 + 1e-9
    assert 0 < s["conversations_started"] < 200
    assert max(r.start_s for r in res.records) <= 1.0
    assert s["requests_failed"] == 0 and s["mode"] == "open" and s["rate"] == 20.0


def test_open_loop_is_seeded_and_bounded_by_max_requests(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=50, n_turns=1)
    starts = []
    for _ in range(2):
        with FakeOpenAIServer.start() as srv:
            res = run_replay(wl, srv.url, opts(mode="open", rate=50.0, max_requests=10, seed=3), tmp_path / "o")
        assert res.summary["requests_total"] == 10
        starts.append(sorted(r.conversation_id for r in res.records))
    assert starts[0] == starts[1]


def test_trace_mode_honours_arrival_timestamps(tmp_path, virtual_time):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=3, n_turns=1, arrival_gap=0.3)
    with virtual_time.server(FakeBehavior(first_token_delay_s=0.5)) as srv:    # longer than the gaps
        res = run_replay(wl, srv.url, opts(mode="trace"), tmp_path / "out")
    starts = {r.conversation_id: r.start_s for r in res.records}
    for i in range(3):
        assert starts[f"c{i}"] == pytest.approx(i * 0.3)      # at its timestamp, not after the previous


def test_server_errors_and_disconnects_are_recorded_and_the_run_continues(tmp_path):
    def user(i, k):
        return {(1, 0): "FAIL500 here", (2, 1): "DISCONNECT here"}.get((i, k), f"fine {i} {k}")
    wl = make_workload(tmp_path / "w.jsonl", n_conv=4, n_turns=2, user_fn=user)
    with FakeOpenAIServer.start() as srv:
        res = run_replay(wl, srv.url, opts(concurrency=2), tmp_path / "out")
    s = res.summary
    assert s["requests_total"] == 8 and s["requests_failed"] == 2 and s["requests_ok"] == 6
    assert s["errors_by_kind"] == {"http_500": 1, "disconnect": 1}
    # the conversation continues after a failed turn (history comes from the workload)
    assert {(r.conversation_id, r.turn) for r in res.records if r.ok} >= {("c1", 1), ("c2", 0)}


def test_unreachable_server_gives_a_clear_error(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ReplayError, match="cannot reach server"):
        run_replay(wl, url, opts(), tmp_path / "out")


def test_unreachable_server_can_be_recorded_instead(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=2, n_turns=2)
    url = f"http://127.0.0.1:{free_port()}"
    res = run_replay(wl, url, opts(stop_on_connect_error=False, model="m"), tmp_path / "out")
    assert res.summary["requests_failed"] == 4 and res.summary["errors_by_kind"] == {"connect": 4}
    assert res.summary["ttft_mean_s"] is None
    assert len(read_records(res.records_path)) == 4


def test_server_dying_mid_run_stops_the_run_and_keeps_partial_results(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=30, n_turns=2, think=0.05)
    srv = FakeOpenAIServer.start(FakeBehavior(first_token_delay_s=0.02))
    import threading
    threading.Timer(0.5, srv.stop).start()
    res = run_replay(wl, srv.url, opts(concurrency=2), tmp_path / "out")
    assert res.stopped_reason.startswith("stopped: cannot connect")
    recs = read_records(res.records_path)
    # records land in completion order: under load an ok request may finish after the failed one
    assert sum(r.ok for r in recs) > 0 and any(r.error_kind in ("connect", "disconnect") for r in recs)
    assert json.loads(res.summary_path.read_text())["requests_ok"] == sum(r.ok for r in recs)


def test_malformed_workload_lines_stop_or_skip(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=3, n_turns=1)
    lines = wl.read_text().splitlines()
    lines.insert(2, "{not json")
    lines.insert(3, json.dumps({"id": "bad", "turns": []}))
    wl.write_text("\n".join(lines) + "\n")
    with FakeOpenAIServer.start() as srv:
        with pytest.raises(ReplayError, match=r"w\.jsonl:3: not valid JSON"):
            run_replay(wl, srv.url, opts(), tmp_path / "out")
        res = run_replay(wl, srv.url, opts(skip_bad_lines=True), tmp_path / "out2")
    assert res.summary["requests_ok"] == 3
    assert res.summary["workload"]["skipped_lines"] == 2
    assert "w.jsonl:4" in res.summary["workload"]["skipped_errors"][1]


@pytest.mark.parametrize("kw,msg", [({"mode": "open"}, "rate"), ({"concurrency": 0}, "concurrency"),
                                    ({"mode": "bogus"}, "unknown mode")])
def test_bad_options_are_rejected(tmp_path, kw, msg):
    wl = make_workload(tmp_path / "w.jsonl")
    with pytest.raises(ReplayError, match=msg):
        run_replay(wl, "http://127.0.0.1:1", opts(**kw), tmp_path / "out")


def test_hit_rate_over_time_shows_warm_up(tmp_path, virtual_time):
    # 2 conversations, then the same 2 three more times: everything after the first pass is
    # fully cached, and the last half of the run (by time) holds repeats only
    wl = make_workload(tmp_path / "w.jsonl", n_conv=2, n_turns=2)
    lines = wl.read_text().splitlines()
    wl.write_text("\n".join(lines + lines[1:] * 3) + "\n")
    with virtual_time.server(FakeBehavior(first_token_delay_s=0.05)) as srv:
        res = run_replay(wl, srv.url, opts(concurrency=1, windows=2), tmp_path / "out")
    s = res.summary
    assert s["token_hit_rate_last_half"] > s["hit_rate_over_time"][0]["token_hit_rate"]
    assert s["token_hit_rate_last_half"] == pytest.approx(1.0, abs=0.02)


def test_duration_cancels_requests_still_in_flight_after_the_drain_timeout(tmp_path, virtual_time):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=4, n_turns=1)
    with virtual_time.server(FakeBehavior(first_token_delay_s=5.0)) as srv:
        res = run_replay(wl, srv.url, opts(concurrency=2, duration_s=0.3, drain_timeout_s=0.3), tmp_path / "out")
    s = res.summary
    assert s["requests_cancelled"] == 2 and s["requests_total"] == 0
    assert s["duration_s"] == pytest.approx(0.6) and res.stopped_reason == "duration reached"   # bound + drain


def test_kvtier_series_come_only_from_kvtier_endpoints() -> None:
    from kvtier.client.server_metrics import merge, parse_metrics, server_delta

    api = parse_metrics("vllm:prefix_cache_hits_total 5\nvllm:prefix_cache_queries_total 10\n"
                        "kvtier_connector_load_bytes_total 0\nkvtier_store_hits_total{tier=\"disk\"} 0\n")
    own = parse_metrics("kvtier_connector_load_bytes_total 4096\nkvtier_store_hits_total{tier=\"disk\"} 3\n")
    before = merge([(parse_metrics(""), False), (parse_metrics(""), True)])
    after = merge([(api, False), (own, True)])
    d = server_delta(before, after)
    assert d["kvtier"] == {"kvtier_connector_load_bytes_total": 4096.0, "kvtier_store_hits_total{tier=disk}": 3.0}
    assert d["prefix_cache_hits"] == 5.0
    only_api = server_delta(merge([(parse_metrics(""), False)]), merge([(api, False)]))
    assert only_api["kvtier"] == {}       # the API server's zeros are not printed as measurements
