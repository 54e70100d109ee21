"""Async streaming client for OpenAI-compatible servers; one ``RequestRecord`` per request.

Timing contract: the body is encoded and the request built first; the clock
(``time.perf_counter``) starts immediately before the request is sent. TTFT is the
arrival of the first SSE chunk carrying generated text (falling back to the first chunk
with any choice when no text ever arrives); inter-token latencies are the gaps between
later text-bearing chunks; e2e is the end of the stream. Usage comes from the final
``include_usage`` chunk; ``cached_tokens`` from ``usage.prompt_tokens_details`` when the
server reports it (vLLM: ``--enable-prompt-tokens-details``), else ``None``.

The generated text (``delta.content`` / ``text`` of every chunk, reasoning excluded) is kept in
``reply``: live-history replay (``kvtier.client.history``) sends it back as the assistant message of
the next turn, and the prompts actually sent can be rebuilt from the records. When the server
streams token ids (vLLM with ``return_token_ids: true`` in the body, e.g. through
``ClientOptions.extra_body``) they are kept too: ``prompt_token_ids`` (the prompt as the server
tokenized it) and ``token_ids`` (the generated ids), else both stay ``None``.

Cluster runs: ``ClientOptions.conversation_header`` sends the conversation id in that header (a
balancer hashes it for sticky routing); ``served_by_header`` names the response header a balancer
sets to the replica that served the request, kept in ``replica``; ``send_turn(url=...)`` sends to
that server instead of the client's base URL (a client-side router), and ``replica`` then names it.

Failures never raise: they are recorded as ``error_kind`` in
{connect, timeout, http_<status>, disconnect, incomplete, stream_error, bad_response}.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvtier.workload.format import Conversation

Message = dict[str, str]

CONNECT_ERROR = "connect"


@dataclass
class RequestRecord:
    conversation_id: str
    turn: int
    api: str                                 # "chat" | "completions"
    start_s: float                           # send time, seconds since the run started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    max_tokens: int | None = None            # as SENT (after ClientOptions.extra_body overrides)
    workload_max_tokens: int | None = None   # what the workload's turn asked for
    overrides: list[str] = field(default_factory=list)   # request fields set by extra_body
    error_kind: str | None = None
    error: str | None = None
    timed_out: bool = False
    history: str = "workload"                # whose assistant messages the prompt carried: workload | live
    history_fallbacks: int = 0               # live: earlier turns that failed, their workload text sent instead
    reply: str | None = None                 # the generated text as streamed (None: nothing arrived)
    prompt_token_ids: list[int] | None = None  # only when the server streams them (vLLM return_token_ids)
    token_ids: list[int] | None = None       # the generated ids, idem
    replica: str | None = None               # which server served it (balancer header or the router's choice)

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**d)


@dataclass(frozen=True)
class ClientOptions:
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    ignore_eos: bool = True          # vLLM extension: every config decodes exactly max_tokens
    extra_body: tuple[tuple[str, Any], ...] = ()
    conversation_header: str | None = None   # send the conversation id in this header (sticky balancing)
    served_by_header: str | None = None      # response header naming the replica that served (-> replica)


def request_body(model: str, conv: Conversation, k: int, opts: ClientOptions,
                 messages: list[Message] | None = None) -> tuple[str, dict[str, Any]]:
    """(endpoint path, JSON body) for turn ``k``: completions with token ids, else chat with
    ``messages`` (default: the workload's history, ``Conversation.chat_messages``)."""
    turn = conv.turns[k]
    body: dict[str, Any] = {"model": model, "max_tokens": turn.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    body.update(dict(opts.extra_body))
    if turn.prompt_token_ids is not None:
        body["prompt"] = turn.prompt_token_ids
        return "/v1/completions", body
    body["messages"] = messages if messages is not None else conv.chat_messages(k)
    return "/v1/chat/completions", body


def make_http_client(base_url: str, opts: ClientOptions) -> httpx.AsyncClient:
    """One pooled client per run; no connection limit so the pool never queues requests."""
    timeout = httpx.Timeout(opts.request_timeout_s, connect=opts.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits)


def _chunk_text(chunk: dict[str, Any]) -> tuple[bool, bool, str]:
    """(has_choice, has_text, reply text) for one streamed chunk; reasoning counts as text for
    the clock but is not part of the reply."""
    choices = chunk.get("choices") or []
    has_text = False
    text = ""
    for ch in choices:
        delta = ch.get("delta") or {}
        if ch.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            has_text = True
        piece = ch.get("text") if "text" in ch else delta.get("content")
        if isinstance(piece, str):
            text += piece
    return bool(choices), has_text, text


def _collect_ids(rec: RequestRecord, chunk: dict[str, Any]) -> None:
    """Token ids a server streams on request (vLLM ``return_token_ids``): prompt ids once, generated per chunk."""
    prompt = chunk.get("prompt_token_ids")
    if isinstance(prompt, list) and rec.prompt_token_ids is None:
        rec.prompt_token_ids = [int(t) for t in prompt]
    for ch in chunk.get("choices") or []:
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            rec.token_ids = (rec.token_ids or []) + [int(t) for t in ids]


def _apply_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
    rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


async def send_turn(client: httpx.AsyncClient, model: str, conv: Conversation, k: int,
                    opts: ClientOptions, run_t0: float, messages: list[Message] | None = None,
                    history: str = "workload", history_fallbacks: int = 0,
                    url: str | None = None, replica: str | None = None) -> RequestRecord:
    """Send turn ``k`` of ``conv`` (with ``messages`` when given, see ``request_body``) and stream
    the answer; to ``url`` (a server root, named ``replica``) instead of the client's base URL when
    given. Never raises (except cancellation)."""
    path, body = request_body(model, conv, k, opts, messages)
    rec = RequestRecord(conversation_id=conv.id, turn=k, api="completions" if "prompt" in body else "chat",
                        start_s=0.0, max_tokens=body.get("max_tokens"), workload_max_tokens=conv.turns[k].max_tokens,
                        overrides=sorted(name for name, _ in opts.extra_body), history=history,
                        history_fallbacks=history_fallbacks, replica=replica)
    pieces: list[str] = []
    headers = {"content-type": "application/json"}
    if opts.conversation_header:
        headers[opts.conversation_header] = conv.id
    target = f"{url.rstrip('/')}{path}" if url else path
    request = client.build_request("POST", target, content=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    rec.start_s = t0 - run_t0
    first_choice: float | None = None
    last_text: float | None = None
    done = False
    try:
        async with asyncio.timeout(opts.request_timeout_s):
            resp = await client.send(request, stream=True)
            if opts.served_by_header and resp.headers.get(opts.served_by_header):
                rec.replica = resp.headers[opts.served_by_header]
            try:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    rec.error_kind, rec.error = f"http_{resp.status_code}", detail.strip() or resp.reason_phrase
                    return rec
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue  # blank separators, ": keep-alive" comments, event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        rec.error_kind, rec.error = "bad_response", f"unparseable SSE data: {data[:120]!r}"
                        return rec
                    if "error" in chunk and not chunk.get("choices"):
                        err = chunk["error"]
                        rec.error_kind = "stream_error"
                        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                        return rec
                    has_choice, has_text, piece = _chunk_text(chunk)
                    if piece:
                        pieces.append(piece)
                    _collect_ids(rec, chunk)
                    if has_choice and first_choice is None:
                        first_choice = now
                    if has_text:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last_text)
                        last_text = now
                    if chunk.get("usage"):
                        _apply_usage(rec, chunk["usage"])
            finally:
                await resp.aclose()
                if pieces:
                    rec.reply = "".join(pieces)
        end = time.perf_counter()
        if not done:
            rec.error_kind, rec.error = "incomplete", "stream ended without [DONE]"
            return rec
        if rec.ttft_s is None and first_choice is not None:
            rec.ttft_s = first_choice - t0
        if rec.ttft_s is None:
            rec.error_kind, rec.error = "bad_response", "stream finished without any choice"
            return rec
        rec.e2e_s = end - t0
        return rec
    except TimeoutError:
        rec.error_kind, rec.error, rec.timed_out = "timeout", f"no complete answer within {opts.request_timeout_s} s", True
    except httpx.TimeoutException as e:
        rec.error_kind, rec.error, rec.timed_out = "timeout", f"{type(e).__name__}: {e}", True
    except httpx.ConnectError as e:
        rec.error_kind, rec.error = CONNECT_ERROR, f"cannot connect to {url or client.base_url}: {e}"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        rec.error_kind, rec.error = "disconnect", f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        rec.error_kind, rec.error = "disconnect", f"{type(e).__name__}: {e}"
    return rec


async def discover_model(client: httpx.AsyncClient) -> str:
    """The first model id the server lists at ``GET /v1/models``."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{client.base_url}/v1/models lists no model")
    return str(data[0]["id"])
