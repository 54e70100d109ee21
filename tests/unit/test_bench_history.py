"""Live-history replay (`--history live`): prompts carry the replies the server streamed, against the fake server."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from kvtier.client.stream import RequestRecord
from kvtier.client.history import HistoryError, check_history, live_messages, sent_messages
from kvtier.client.live_ideal import sent_ideal
from kvtier.client.replay import ReplayError, ReplayOptions, load_conversations, read_records, run_replay
from kvtier.client.summary import summarize
from kvtier.commands import bench_cmd
from kvtier.workload.format import Conversation, HistoryMessage, Turn, WorkloadHeader, write_workload
from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer
from tests.unit.test_bench_replay import by_conv, make_workload
from tests.unit.workload_fakes import WordTokenizer


def _opts(**kw) -> ReplayOptions:
    kw.setdefault("progress", False)
    return ReplayOptions(**kw)


def test_live_history_sends_each_conversations_own_streamed_replies(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=3, n_turns=3, think=0.02)
    with FakeOpenAIServer.start(FakeBehavior(first_token_delay_s=0.01, tagged_replies=True)) as srv:
        res = run_replay(wl, srv.url, _opts(concurrency=2, history="live"), tmp_path / "out")
        reqs = list(srv.state.requests)
    assert res.summary["requests_ok"] == 9 and res.summary["history"] == "live"
    number = {id(r): i + 1 for i, r in enumerate(reqs)}            # the fake numbers requests from 1
    for cid, rs in by_conv(reqs).items():
        assert len(rs) == 3
        for k, cur in enumerate(rs):
            msgs = cur.body["messages"]
            assert msgs[0] == {"role": "system", "content": f"system prompt {cid}"}
            assert msgs[-1]["content"].startswith(f"conv {cid} question {k}")
            # turn k carries exactly what the server generated for this conversation's turns 0..k-1
            expected = ["".join(f"r{number[id(rs[j])]}t{i} " for i in range(4)) for j in range(k)]
            assert [m["content"] for m in msgs if m["role"] == "assistant"] == expected
            assert not any("WORKLOAD-ASSISTANT" in m["content"] for m in msgs)
    recs = read_records(tmp_path / "out" / "requests.jsonl")
    assert {r.history for r in recs} == {"live"} and all(r.reply and r.reply.startswith("r") for r in recs)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["history"] == "live"


def test_workload_history_is_the_default_and_records_say_so(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=2, n_turns=2)
    with FakeOpenAIServer.start(FakeBehavior(tagged_replies=True)) as srv:
        res = run_replay(wl, srv.url, _opts(concurrency=2), tmp_path / "out")
        reqs = list(srv.state.requests)
    assert res.summary["history"] == "workload" and {r.history for r in res.records} == {"workload"}
    later = [r for r in reqs if len(r.body["messages"]) > 2]
    assert later and all(m["content"].startswith("WORKLOAD-ASSISTANT") for r in later
                         for m in r.body["messages"] if m["role"] == "assistant")
    assert all(r.reply for r in res.records), "the streamed text is recorded in both modes"


def test_a_failed_turn_is_replaced_by_its_workload_text_and_counted(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=1, n_turns=3,
                       user_fn=lambda i, k: f"conv {i} question {k} " + ("FAIL500" if k == 1 else "fine"))
    with FakeOpenAIServer.start(FakeBehavior(tagged_replies=True)) as srv:
        res = run_replay(wl, srv.url, _opts(concurrency=1, history="live"), tmp_path / "out")
        reqs = list(srv.state.requests)
    assert res.summary["requests_failed"] == 1 and res.summary["requests_with_history_fallback"] == 1
    last = reqs[-1].body["messages"]
    assert [m["content"] for m in last if m["role"] == "assistant"] == \
        ["r1t0 r1t1 r1t2 r1t3 ", "WORKLOAD-ASSISTANT-0-1"]
    assert [r.history_fallbacks for r in sorted(res.records, key=lambda r: r.turn)] == [0, 0, 1]


def test_messages_rebuilt_from_the_records_are_what_the_server_received(tmp_path):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=4, n_turns=3,
                       user_fn=lambda i, k: f"conv {i} question {k} " + ("DISCONNECT" if (i, k) == (2, 0) else "ok"))
    with FakeOpenAIServer.start(FakeBehavior(tagged_replies=True)) as srv:
        run_replay(wl, srv.url, _opts(concurrency=3, history="live"), tmp_path / "out")
        received = sorted(json.dumps(r.body["messages"]) for r in srv.state.requests)
    convs, _ = load_conversations(wl, False)
    rebuilt = sorted(json.dumps(m) for _, m in sent_messages(convs, read_records(tmp_path / "out" / "requests.jsonl")))
    assert rebuilt == received


def test_live_history_refuses_token_id_prompts_in_one_line(tmp_path):
    convs = [Conversation(id="t0", turns=[Turn(prompt_token_ids=[1, 2, 3]), Turn(prompt_token_ids=[1, 2, 3, 4])])]
    write_workload(tmp_path / "ids.jsonl", WorkloadHeader(name="ids"), convs)
    with pytest.raises(HistoryError, match="token-id prompt"):
        check_history("live", convs)
    check_history("workload", convs)
    with FakeOpenAIServer.start() as srv:
        with pytest.raises(ReplayError, match="--history workload"):
            run_replay(tmp_path / "ids.jsonl", srv.url, _opts(history="live"), tmp_path / "out")
        app = typer.Typer()
        bench_cmd.register(app)
        r = CliRunner().invoke(app, ["run", str(tmp_path / "ids.jsonl"), "--base-url", srv.url, "--history", "live",
                                     "--no-progress", "--out", str(tmp_path / "o2")])
        assert r.exit_code == 1 and "token-id prompt" in r.output and "Traceback" not in r.output
        assert not srv.state.requests, "nothing is sent before the refusal"
        bad = CliRunner().invoke(app, ["run", str(tmp_path / "ids.jsonl"), "--base-url", srv.url, "--history", "model"])
        assert bad.exit_code == 2 and "--history" in bad.output


def test_live_messages_keep_system_and_resumed_history():
    conv = Conversation(id="c", system="sys", history=[HistoryMessage(role="user", content="old q"),
                                                       HistoryMessage(role="assistant", content="old a")],
                        turns=[Turn(user="q0", assistant="w0"), Turn(user="q1", assistant="w1"), Turn(user="q2")])
    msgs, fb = live_messages(conv, 2, ["live0", None])
    assert fb == 1
    assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "old q"},
                    {"role": "assistant", "content": "old a"}, {"role": "user", "content": "q0"},
                    {"role": "assistant", "content": "live0"}, {"role": "user", "content": "q1"},
                    {"role": "assistant", "content": "w1"}, {"role": "user", "content": "q2"}]
    assert live_messages(conv, 0, [])[0] == conv.chat_messages(0)
    with pytest.raises(ValueError):
        live_messages(conv, 2, ["only one"])


def _rec(cid: str, turn: int, start: float, reply: str | None, history: str = "live", **kw) -> RequestRecord:
    return RequestRecord(conversation_id=cid, turn=turn, api="chat", start_s=start, ttft_s=0.1, e2e_s=0.2,
                         reply=reply, history=history, **kw)


def test_sent_ideal_counts_prompt_blocks_and_reply_blocks():
    """WordTokenizer: one token per word; turn 1's prompt = turn 0's prompt + the reply + 2 + the next user turn."""
    conv = Conversation(id="c", system="s " * 3, turns=[Turn(user="u " * 3, assistant="w"), Turn(user="v " * 3)])
    reply = "a a a a"
    recs = [_rec("c", 0, 0.0, reply), _rec("c", 1, 1.0, "b")]
    tok = WordTokenizer()
    p0 = tok.render_chat(live_messages(conv, 0, [])[0])
    p1 = tok.render_chat(live_messages(conv, 1, [reply])[0])
    assert len(tok.encode(reply)) == 4 and p1[:len(p0) + 4] == p0 + tok.encode(reply)
    ideal = sent_ideal([conv], recs, tok, block_size=2)
    assert ideal.requests == 2 and ideal.prompt_tokens == len(p0) + len(p1)
    assert ideal.hit_tokens_prompts == (len(p0) // 2) * 2                       # turn 0's full blocks
    assert ideal.hit_tokens_with_replies == ((len(p0) + 4) // 2) * 2            # ... and the reply's
    assert ideal.with_replies > ideal.prompts
    # workload history: the model's reply is never in a later prompt, so it buys nothing
    wl = sent_ideal([conv], [_rec("c", 0, 0.0, reply, "workload"), _rec("c", 1, 1.0, "b", "workload")], tok, 2)
    assert wl.hit_tokens_with_replies == wl.hit_tokens_prompts


def test_summary_reports_computed_tokens_and_ttft_spread():
    recs = [_rec("c", k, float(k), "x", prompt_tokens=100 * (k + 1), cached_tokens=50 * k, output_tokens=4)
            for k in range(4)]
    for k, r in enumerate(recs):
        r.ttft_s = 0.1 * (k + 1)
    s = summarize(recs, duration_s=4.0, extra={"history": "live"})
    assert s["computed_tokens_per_request"] == pytest.approx((100 + 150 + 200 + 250) / 4)
    assert s["output_tokens_total"] == 16 and s["output_tokens_per_s"] == pytest.approx(4.0)
    assert s["ttft_p10_s"] == pytest.approx(0.13) and s["ttft_spread_s"] == pytest.approx(0.37 - 0.13)
    b = s["by_prompt_length"]["256-1K"]
    assert b["requests"] == 2 and b["ttft_spread_s"] == pytest.approx(0.4 * 0.9 + 0.3 * 0.1 - (0.3 * 0.9 + 0.4 * 0.1))
    no_cached = summarize([_rec("c", 0, 0.0, "x", prompt_tokens=10)], duration_s=1.0)
    assert no_cached["computed_tokens_per_request"] is None


def test_token_ids_a_server_streams_are_kept():
    """vLLM with return_token_ids: prompt ids in the first chunk, generated ids per chunk."""
    from kvtier.client.stream import _collect_ids

    rec = RequestRecord(conversation_id="c", turn=0, api="chat", start_s=0.0)
    _collect_ids(rec, {"choices": [{"delta": {"role": "assistant"}}], "prompt_token_ids": [1, 2, 3]})
    _collect_ids(rec, {"choices": [{"delta": {"content": "a"}, "token_ids": [7]}]})
    _collect_ids(rec, {"choices": [{"delta": {"content": "b c"}, "token_ids": [8, 9]}], "prompt_token_ids": [5]})
    assert rec.prompt_token_ids == [1, 2, 3] and rec.token_ids == [7, 8, 9]
    plain = RequestRecord(conversation_id="c", turn=0, api="chat", start_s=0.0)
    _collect_ids(plain, {"choices": [{"delta": {"content": "a"}}]})
    assert plain.prompt_token_ids is None and plain.token_ids is None
