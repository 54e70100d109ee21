"""A fake streaming OpenAI-compatible server for bench tests (starlette + uvicorn).

Serves ``/health``, ``/v1/models``, ``/metrics`` (vLLM-named counters and TTFT histogram,
plus a ``kvtier_*`` counter), ``/v1/chat/completions`` and ``/v1/completions`` with SSE
streaming. Behaviour knobs (``FakeBehavior``) set the first-chunk delay, the per-token
delay and a first-token delay that grows with the number of in-flight requests. Prompt
tokens are whitespace words (chat) or the given ids (completions); ``cached_tokens`` is
the longest prefix already seen in an earlier prompt, like an unbounded prefix cache.
A last user message containing ``FAIL500`` gets HTTP 500; ``DISCONNECT`` drops the connection
after the first content chunk. With ``tagged_replies`` every generated piece names the request
(``r<request number>t<i> ``), so a test can tell whose reply a later prompt carries.

In tests: ``with FakeOpenAIServer.start(FakeBehavior(...)) as srv: srv.url``.
As a script (launcher tests): ``python fake_openai_server.py --port P [--first-token-delay S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"


@dataclass
class FakeBehavior:
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    ttft_per_active_s: float = 0.0      # added first-token delay per in-flight request (incl. this one)
    report_cached_tokens: bool = True
    fail_marker: str = "FAIL500"
    disconnect_marker: str = "DISCONNECT"
    tagged_replies: bool = False


@dataclass
class FakeRequest:
    path: str
    body: dict[str, Any]
    arrival: float                       # time.perf_counter() at handler entry
    end: float | None = None
    active_at_arrival: int = 0


@dataclass
class FakeState:
    behavior: FakeBehavior
    requests: list[FakeRequest] = field(default_factory=list)
    active: int = 0
    seen_prefixes: set[int] = field(default_factory=set)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0

    def cached_prefix(self, tokens: list) -> int:
        """Length of the longest prefix seen before; then remember all prefixes of ``tokens``."""
        h, hashes = 0, []
        for t in tokens:
            h = hash((h, t))
            hashes.append(h)
        cached = 0
        for i, hv in enumerate(hashes):
            if hv in self.seen_prefixes:
                cached = i + 1
            else:
                break
        self.seen_prefixes.update(hashes)
        return cached


def _prompt_tokens(body: dict[str, Any]) -> tuple[list, str]:
    """(prompt tokens, text of the last message — where failure markers are looked for)."""
    if "messages" in body:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in body["messages"])
        return text.split(), body["messages"][-1]["content"]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return list(prompt), ""
    return str(prompt).split(), str(prompt)


def _metrics_text(st: FakeState) -> str:
    lbl = f'{{model_name="{MODEL}"}}'
    return "\n".join([
        "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{lbl} {st.prompt_tokens}",
        "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{lbl} {st.cached_tokens}",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{MODEL}"}} {st.ttft_count}',
        f"vllm:time_to_first_token_seconds_count{lbl} {st.ttft_count}",
        f"vllm:time_to_first_token_seconds_sum{lbl} {st.ttft_sum}",
        "# TYPE kvtier_fake_requests counter", f"kvtier_fake_requests_total {len(st.requests)}", ""])


def build_app(state: FakeState) -> Starlette:
    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(_metrics_text(state))

    async def generate(request: Request) -> Any:
        body = await request.json()
        b = state.behavior
        state.active += 1
        rec = FakeRequest(request.url.path, body, time.perf_counter(), active_at_arrival=state.active)
        state.requests.append(rec)
        tokens, text = _prompt_tokens(body)
        if b.fail_marker and b.fail_marker in text:
            state.active -= 1
            rec.end = time.perf_counter()
            return JSONResponse({"error": {"message": "injected failure", "code": 500}}, status_code=500)
        cached = state.cached_prefix(tokens)
        state.prompt_tokens += len(tokens)
        state.cached_tokens += cached
        chat = "messages" in body
        n_out = int(body.get("max_tokens", 16))
        cid, created = f"fake-{len(state.requests)}", int(time.time())
        number = len(state.requests)

        def piece(i: int) -> str:
            return f"r{number}t{i} " if b.tagged_replies else f"tok{i} "

        def chunk(delta_text: str | None, role: bool = False, finish: str | None = None) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": delta_text}
                choice = {"index": 0, "delta": delta if delta_text is not None or role else {}, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish}
                obj = "text_completion"
            return "data: " + json.dumps({"id": cid, "object": obj, "created": created, "model": MODEL,
                                          "choices": [choice]}) + "\n\n"

        async def stream():
            try:
                await asyncio.sleep(b.first_token_delay_s + b.ttft_per_active_s * rec.active_at_arrival)
                state.ttft_sum += time.perf_counter() - rec.arrival
                state.ttft_count += 1
                if chat:
                    yield chunk(None, role=True)
                yield chunk(piece(0))
                if b.disconnect_marker and b.disconnect_marker in text:
                    raise ConnectionAbortedError("injected disconnect")
                for i in range(1, n_out):
                    if b.token_delay_s:
                        await asyncio.sleep(b.token_delay_s)
                    yield chunk(piece(i))
                yield chunk(None, finish="length")
                usage: dict[str, Any] = {"prompt_tokens": len(tokens), "completion_tokens": n_out,
                                         "total_tokens": len(tokens) + n_out}
                if b.report_cached_tokens:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                yield "data: " + json.dumps({"id": cid, "object": "usage", "created": created, "model": MODEL,
                                             "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.active -= 1
                rec.end = time.perf_counter()

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/completions", generate, methods=["POST"])])


class FakeOpenAIServer:
    """The fake server on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, state: FakeState, server: uvicorn.Server, thread: threading.Thread, port: int):
        self.state, self._server, self._thread, self.port = state, server, thread, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def behavior(self) -> FakeBehavior:
        return self.state.behavior

    @classmethod
    def start(cls, behavior: FakeBehavior | None = None) -> "FakeOpenAIServer":
        from kvtier.ports import free_port
        state = FakeState(behavior or FakeBehavior())
        port = free_port()
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="critical",
                                lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60          # liveness only: a niced run beside busy cores is slow
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return cls(state, server, thread, port)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> "FakeOpenAIServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--first-token-delay", type=float, default=0.0)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--startup-delay", type=float, default=0.0)
    a = ap.parse_args()
    time.sleep(a.startup_delay)
    state = FakeState(FakeBehavior(first_token_delay_s=a.first_token_delay, token_delay_s=a.token_delay))
    print(f"fake server on port {a.port}", flush=True)
    uvicorn.run(build_app(state), host="127.0.0.1", port=a.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
