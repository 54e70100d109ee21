"""The streaming client's clock and error recording, against the fake OpenAI server."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvtier.client.stream import ClientOptions, RequestRecord, make_http_client, request_body, send_turn
from kvtier.workload.format import Conversation, Turn
from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer
from tests.unit.virtual_time import virtual_time  # noqa: F401


def conv(user: str = "hello there", **turn_kw) -> Conversation:
    return Conversation(id="c1", system="be brief",
                        turns=[Turn(user="first question", assistant="WORKLOAD-ANSWER-0"),
                               Turn(user=user, max_tokens=5, **turn_kw)])


def send(url: str, c: Conversation, k: int, opts: ClientOptions = ClientOptions()) -> RequestRecord:
    async def go() -> RequestRecord:
        async with make_http_client(url, opts) as client:
            return await send_turn(client, "fake-model", c, k, opts, run_t0=0.0)
    return asyncio.run(go())


def test_ttft_clock_matches_first_chunk_delay(virtual_time):
    # in virtual time (tests/unit/virtual_time.py): the only time that passes is the fake's delays, so
    # the clock is checked exactly (real seconds gained up to 0.5 s of scheduling on a loaded machine)
    delay = 0.3
    with virtual_time.server(FakeBehavior(first_token_delay_s=delay, token_delay_s=0.02)) as srv:
        async def go() -> RequestRecord:
            async with virtual_time.http_client(srv.url, ClientOptions()) as client:
                return await send_turn(client, "fake-model", conv(), 1, ClientOptions(), run_t0=0.0)
        rec = asyncio.run(go())
    assert rec.ok, rec.error
    # the clock starts before the send and stops at the first chunk: TTFT is the server's delay
    assert rec.ttft_s == pytest.approx(delay, abs=1e-9), rec.ttft_s
    assert rec.output_tokens == 5 and len(rec.itl_s) == 4
    assert all(x == pytest.approx(0.02, abs=1e-9) for x in rec.itl_s), rec.itl_s
    assert rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-6


def test_usage_and_cached_tokens_recorded():
    with FakeOpenAIServer.start() as srv:
        r0 = send(srv.url, conv(), 0)
        r1 = send(srv.url, conv(), 1)
    assert r0.ok and r1.ok
    assert r0.cached_tokens == 0 and r0.prompt_tokens > 0
    # turn 1's prompt extends turn 0's prompt, so the fake prefix cache covers all of turn 0
    assert r1.cached_tokens == r0.prompt_tokens and r1.prompt_tokens > r0.prompt_tokens


def test_cached_tokens_absent_when_not_reported():
    with FakeOpenAIServer.start(FakeBehavior(report_cached_tokens=False)) as srv:
        rec = send(srv.url, conv(), 0)
    assert rec.ok and rec.cached_tokens is None and rec.prompt_tokens is not None


def test_chat_body_carries_workload_history_and_completions_use_token_ids():
    c = conv()
    path, body = request_body("m", c, 1, ClientOptions())
    assert path == "/v1/chat/completions" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0
    assert {"role": "assistant", "content": "WORKLOAD-ANSWER-0"} in body["messages"]
    tc = Conversation(id="t", turns=[Turn(prompt_token_ids=[5, 6, 7], max_tokens=3)])
    path, body = request_body("m", tc, 0, ClientOptions())
    assert path == "/v1/completions" and body["prompt"] == [5, 6, 7] and body["max_tokens"] == 3
    with FakeOpenAIServer.start() as srv:
        rec = send(srv.url, tc, 0)
    assert rec.ok and rec.api == "completions" and rec.prompt_tokens == 3 and rec.output_tokens == 3


@pytest.mark.parametrize("user,kind", [("please FAIL500 now", "http_500"), ("DISCONNECT me", "disconnect")])
def test_server_errors_are_recorded_not_raised(user, kind):
    with FakeOpenAIServer.start() as srv:
        rec = send(srv.url, conv(user), 1)
    assert not rec.ok and rec.error_kind == kind and rec.error


def test_unreachable_server_is_a_connect_error():
    from kvtier.ports import free_port
    rec = send(f"http://127.0.0.1:{free_port()}", conv(), 0)
    assert rec.error_kind == "connect" and "cannot connect" in rec.error


def test_request_timeout_is_flagged():
    with FakeOpenAIServer.start(FakeBehavior(first_token_delay_s=2.0)) as srv:
        rec = send(srv.url, conv(), 0, ClientOptions(request_timeout_s=0.3))
    assert rec.error_kind == "timeout" and rec.timed_out and rec.ttft_s is None


def test_record_round_trips_through_json():
    import json
    rec = RequestRecord(conversation_id="c", turn=2, api="chat", start_s=1.5, ttft_s=0.1, itl_s=[0.01])
    assert RequestRecord.from_dict(json.loads(rec.to_json())) == rec


def test_record_keeps_the_request_actually_sent() -> None:
    opts = ClientOptions(extra_body=(("max_tokens", 1),))     # what the demos do
    with FakeOpenAIServer.start(FakeBehavior()) as srv:
        rec = send(srv.url, conv(), 1, opts)
    assert rec.ok, rec.error
    assert rec.max_tokens == 1 and rec.workload_max_tokens == 5 and rec.overrides == ["max_tokens"]
    assert rec.output_tokens == 1                              # the server decoded what was sent
    again = RequestRecord.from_dict(json.loads(rec.to_json()))
    assert again == rec
    with FakeOpenAIServer.start(FakeBehavior()) as srv:
        plain = send(srv.url, conv(), 1)
    assert plain.max_tokens == plain.workload_max_tokens == 5 and plain.overrides == []
