"""Replay a workload against an OpenAI-compatible server and measure it.

Ordering contract: within a conversation, turn k+1 is sent only after turn k finished
(successfully or not) plus ``think_time_s * think_time_scale``; in trace mode also not
before the turn's ``arrival_s``. Conversations interleave freely. ``history`` decides whose
assistant messages a prompt carries (``kvtier.client.history``): ``workload`` (default) the
workload's text, so every server configuration sees identical prompts; ``live`` the replies this
server streamed for the conversation's earlier turns, as a real chat client does.

Load modes:
- closed: ``concurrency`` users; each takes the next conversation when its last one ended.
- open:   new conversations arrive as a Poisson process of ``rate`` per second (seeded).
- trace:  conversation i starts at ``arrival_s * time_scale``.

Routing: by default every request goes to ``url`` (a server, or a balancer in front of several);
with a ``RequestRouter`` the client picks the server per request (``pick`` before sending,
``finished`` after the answer, failed or not), a client-side router such as ``kvtier.client.router``.

Bounds: ``max_requests`` (requests issued) and ``duration_s`` (no request is sent after
it; in-flight requests get ``drain_timeout_s`` to finish, then are cancelled and counted).
A connection failure stops the run with a clear reason when ``stop_on_connect_error``
(records so far are kept); HTTP errors and mid-stream disconnects are recorded and the run
continues. Records are appended to the JSONL file as they complete.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Protocol, Sequence

import httpx

from kvtier.client.stream import (CONNECT_ERROR, ClientOptions, Message, RequestRecord, discover_model,
                                 make_http_client, send_turn)
from kvtier.client.history import HISTORY_MODES, HistoryError, HistoryMode, check_history, live_messages, live_reply
from kvtier.client.server_metrics import scrape_all, server_delta
from kvtier.client.summary import summarize
from kvtier.workload.format import Conversation, WorkloadError, iter_conversations, read_header

Mode = Literal["closed", "open", "trace"]


class ReplayError(RuntimeError):
    """The replay could not run (unreachable server, bad workload, bad options)."""


class RequestRouter(Protocol):
    """Chooses the server of each request (client-side routing)."""

    def pick(self, conv: Conversation, k: int, messages: list[Message] | None) -> tuple[str, str]:
        """(replica name, server root URL) for turn ``k`` of ``conv``; ``messages``: the chat messages
        about to be sent (None: the workload's own, ``conv.chat_messages(k)`` or its token ids)."""
        ...

    def finished(self, replica: str) -> None:
        """The request ``pick`` sent to ``replica`` has ended (answered or failed)."""
        ...


@dataclass(frozen=True)
class ReplayOptions:
    mode: Mode = "closed"
    concurrency: int = 4
    rate: float | None = None                 # open loop: new conversations per second
    max_requests: int | None = None
    duration_s: float | None = None
    think_time_scale: float = 1.0
    time_scale: float = 1.0                   # trace mode: multiplies arrival timestamps
    seed: int = 0
    conversation_offset: int = 0              # start at this conversation (wraps around)
    stop_on_connect_error: bool = True
    skip_bad_lines: bool = False
    drain_timeout_s: float = 60.0
    model: str | None = None                  # None: first id from GET /v1/models
    metrics_url: str | None = None            # None: <url>/metrics
    extra_metrics_urls: tuple[str, ...] = ()  # more /metrics endpoints (kvtier's own port)
    client: ClientOptions = field(default_factory=ClientOptions)
    progress: bool = True
    windows: int = 10                         # hit-rate-over-time windows
    history: HistoryMode = "workload"         # assistant messages: the workload's text, or the model's replies

    def validate(self) -> None:
        if self.mode not in ("closed", "open", "trace"):
            raise ReplayError(f"unknown mode {self.mode!r} (closed, open or trace)")
        if self.history not in HISTORY_MODES:
            raise ReplayError(f"unknown history {self.history!r} (live or workload)")
        if self.mode == "closed" and self.concurrency < 1:
            raise ReplayError("closed loop needs --max-concurrency >= 1")
        if self.mode == "open" and not (self.rate and self.rate > 0):
            raise ReplayError("open loop needs --request-rate > 0 (conversations per second)")
        if self.max_requests is not None and self.max_requests < 1:
            raise ReplayError("max_requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ReplayError("duration must be > 0")


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    summary: dict[str, Any]
    stopped_reason: str
    records_path: Path | None = None
    summary_path: Path | None = None


class _Run:
    """Shared state of one replay: the request budget, the clock and the stop signal."""

    def __init__(self, client: httpx.AsyncClient, model: str, opts: ReplayOptions,
                 on_record: Callable[[RequestRecord], None], router: RequestRouter | None = None):
        self.client, self.model, self.opts, self.on_record = client, model, opts, on_record
        self.router = router
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + opts.duration_s if opts.duration_s else None
        self.stopped = asyncio.Event()
        self.stopped_reason: str | None = None
        self.issued = 0
        self.conversations_started = 0
        self.records: list[RequestRecord] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def halt(self, reason: str) -> None:
        if self.stopped_reason is None:
            self.stopped_reason = reason
        self.stopped.set()

    def may_issue(self) -> bool:
        if self.stopped.is_set():
            return False
        if self.opts.max_requests is not None and self.issued >= self.opts.max_requests:
            self.halt("max_requests reached")
            return False
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.halt("duration reached")
            return False
        return True

    async def sleep_until(self, t_rel: float) -> bool:
        """Sleep until run time ``t_rel``; False if the run stopped or the deadline passed first."""
        delay = t_rel - self.now()
        if self.deadline is not None:
            delay = min(delay, self.deadline - time.perf_counter())
        if delay > 0:
            try:
                await asyncio.wait_for(self.stopped.wait(), timeout=delay)
            except TimeoutError:
                pass
        return self.may_issue()

    async def play(self, conv: Conversation, start_at: float | None) -> None:
        prev_end: float | None = None
        replies: list[str | None] = []        # live history: what the model answered each earlier turn
        for k, turn in enumerate(conv.turns):
            target = start_at if k == 0 and start_at is not None else self.now()
            if prev_end is not None:
                target = prev_end + turn.think_time_s * self.opts.think_time_scale
            if self.opts.mode == "trace" and turn.arrival_s is not None:
                target = max(target, turn.arrival_s * self.opts.time_scale)
            if not await self.sleep_until(target):
                return
            self.issued += 1
            if k == 0:
                self.conversations_started += 1
            live = self.opts.history == "live"
            msgs, fallbacks = live_messages(conv, k, replies) if live else (None, 0)
            replica = url = None
            if self.router is not None:
                replica, url = self.router.pick(conv, k, msgs)
            try:
                rec = await send_turn(self.client, self.model, conv, k, self.opts.client, self.t0, msgs,
                                      history=self.opts.history, history_fallbacks=fallbacks, url=url,
                                      replica=replica)
            finally:
                if self.router is not None and replica is not None:
                    self.router.finished(replica)
            if live:
                replies.append(live_reply(rec))
            prev_end = self.now()
            self.records.append(rec)
            self.on_record(rec)
            if rec.error_kind == CONNECT_ERROR and self.opts.stop_on_connect_error:
                self.halt(f"stopped: {rec.error}")
                return


def _rotate(convs: Sequence[Conversation], offset: int) -> list[Conversation]:
    if not convs:
        return []
    k = offset % len(convs)
    return list(convs[k:]) + list(convs[:k])


def _arrivals(convs: list[Conversation], opts: ReplayOptions) -> Iterator[tuple[float, Conversation]]:
    if opts.mode == "trace":
        def first(c: Conversation) -> float:
            return max(c.arrival_s, c.turns[0].arrival_s or 0.0) * opts.time_scale
        yield from sorted(((first(c), c) for c in convs), key=lambda x: x[0])
        return
    rng = random.Random(opts.seed)
    t = 0.0
    for c in convs:
        yield t, c
        t += rng.expovariate(opts.rate)


async def replay_conversations(convs: Sequence[Conversation], url: str, opts: ReplayOptions,
                               on_record: Callable[[RequestRecord], None] = lambda r: None,
                               progress: Callable[[RequestRecord], None] | None = None,
                               router: RequestRouter | None = None) -> ReplayResult:
    """Replay already-loaded conversations against ``url`` (the server root; with ``router``, the
    server the model is discovered on and the metrics scraped from, each request to the router's pick)."""
    opts.validate()
    try:
        check_history(opts.history, convs)
    except HistoryError as e:
        raise ReplayError(str(e)) from None
    convs = _rotate(convs, opts.conversation_offset)
    metrics_urls = [opts.metrics_url or f"{url.rstrip('/')}/metrics", *opts.extra_metrics_urls]
    async with make_http_client(url, opts.client) as client:
        model = opts.model
        if model is None or opts.stop_on_connect_error:
            try:
                found = await discover_model(client)
                model = model or found
            except httpx.ConnectError as e:
                if opts.stop_on_connect_error:
                    raise ReplayError(f"cannot reach server at {url}: {e}") from None
                model = model or "unknown"   # every request will be recorded as a connect error
            except (httpx.HTTPError, ValueError, KeyError) as e:
                if model is None:
                    raise ReplayError(f"cannot discover the model at {url}/v1/models ({e}); pass --model") from None
        before = await scrape_all(client, metrics_urls, tuple(opts.extra_metrics_urls))

        def record(rec: RequestRecord) -> None:
            on_record(rec)
            if progress:
                progress(rec)

        run = _Run(client, model, opts, record, router)
        tasks: set[asyncio.Task] = set()
        cancelled = 0
        try:
            if opts.mode == "closed":
                queue = iter(convs)

                async def user() -> None:
                    for conv in queue:
                        if not run.may_issue():
                            return
                        await run.play(conv, None)
                tasks = {asyncio.create_task(user()) for _ in range(opts.concurrency)}
            else:
                for t_start, conv in _arrivals(convs, opts):
                    if not await run.sleep_until(t_start):
                        break
                    tasks.add(asyncio.create_task(run.play(conv, t_start)))
            if tasks:
                timeout = None
                if run.deadline is not None:
                    timeout = max(0.0, run.deadline - time.perf_counter()) + opts.drain_timeout_s
                _, pending = await asyncio.wait(tasks, timeout=timeout)
                for t in pending:
                    t.cancel()
                cancelled = len(pending)
                if pending:
                    await asyncio.wait(pending)
        except asyncio.CancelledError:
            run.halt("interrupted")
            for t in tasks:
                t.cancel()
            cancelled = sum(not t.done() for t in tasks)
            await asyncio.gather(*tasks, return_exceptions=True)
        if cancelled and run.deadline is not None and time.perf_counter() >= run.deadline:
            run.halt("duration reached")
        duration = run.now()
        after = await scrape_all(client, metrics_urls, tuple(opts.extra_metrics_urls))
    reason = run.stopped_reason or "workload exhausted"
    server = server_delta(before, after)
    extra = {"mode": opts.mode, "history": opts.history,
             "requests_with_history_fallback": sum(r.history_fallbacks > 0 for r in run.records),
             "concurrency": opts.concurrency if opts.mode == "closed" else None,
             "rate": opts.rate if opts.mode == "open" else None, "url": url, "model": model,
             "stopped_reason": reason, "requests_cancelled": cancelled,
             "conversations_started": run.conversations_started, "server": server}
    summary = summarize(run.records, duration_s=duration, windows=opts.windows, extra=extra)
    client_ttft, server_ttft = summary.get("ttft_mean_s"), server.get("ttft_mean_s")
    summary["client_over_server_ttft"] = client_ttft / server_ttft if client_ttft and server_ttft else None
    return ReplayResult(records=run.records, summary=summary, stopped_reason=reason)


def load_conversations(path: str | Path, skip_bad: bool) -> tuple[list[Conversation], list[str]]:
    """All conversations of a workload; bad lines raise ReplayError unless ``skip_bad``."""
    errors: list[str] = []
    try:
        read_header(path)
        convs = list(iter_conversations(path, skip_bad=skip_bad, errors=errors))
    except WorkloadError as e:
        raise ReplayError(f"bad workload: {e}") from None
    if not convs:
        raise ReplayError(f"workload {path} has no usable conversation")
    return convs, errors


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def read_records(path: str | Path) -> list[RequestRecord]:
    with Path(path).open() as fh:
        return [RequestRecord.from_dict(json.loads(line)) for line in fh if line.strip()]


def run_replay(workload: str | Path, url: str, opts: ReplayOptions, out_dir: str | Path,
               summary_path: str | Path | None = None) -> ReplayResult:
    """Load ``workload``, replay it, write ``out_dir/requests.jsonl`` (incrementally) and the
    summary JSON (``out_dir/summary.json`` unless ``summary_path``). Raises ReplayError."""
    convs, bad_lines = load_conversations(workload, opts.skip_bad_lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "requests.jsonl"
    total = sum(len(c.turns) for c in convs)
    planned = min(total, opts.max_requests) if opts.max_requests else total
    with records_path.open("w") as fh, progress_bar(planned, opts.progress) as bar:
        def on_record(rec: RequestRecord) -> None:
            fh.write(rec.to_json() + "\n")
            fh.flush()
        result = asyncio.run(replay_conversations(convs, url, opts, on_record, bar))
    result.summary["workload"] = {"path": str(workload), "name": read_header(workload).name,
                                  "conversations": len(convs), "requests": total,
                                  "skipped_lines": len(bad_lines), "skipped_errors": bad_lines[:20]}
    result.summary["options"] = {k: v for k, v in asdict(opts).items() if k != "client"}
    result.records_path = records_path
    result.summary_path = Path(summary_path) if summary_path else out / "summary.json"
    write_json(result.summary_path, result.summary)
    return result


class progress_bar:
    """A rich progress bar fed one record at a time (a no-op when disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.ok = self.failed = 0

    def __enter__(self) -> "progress_bar":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._p = Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("ok {task.fields[ok]} failed {task.fields[failed]}"),
                               TimeElapsedColumn(), transient=False)
            self._p.start()
            self._task = self._p.add_task("replay", total=self.total, ok=0, failed=0)
        return self

    def __call__(self, rec: RequestRecord) -> None:
        if rec.ok:
            self.ok += 1
        else:
            self.failed += 1
        if self.enabled:
            self._p.update(self._task, advance=1, ok=self.ok, failed=self.failed)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._p.stop()
