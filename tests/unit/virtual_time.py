"""Virtual time for the bench/demo tests: deterministic timings on a loaded machine, no real sleeps.

Timing tests against the fake OpenAI server (``fake_openai_server.py``) used to measure real
seconds: on a loaded 2-core machine every request gained scheduling latency, so a test either
needed wide margins or failed. Here the replay client, the fake server and every asyncio timer
share ONE clock that only moves when nothing else can run: when the event loop would wait, the
clock jumps to the next timer. The fake server is reached in-process through an httpx transport
that streams from its ASGI app (no sockets, no threads), so the only time that passes is the time
the fake's behaviour asks for — a TTFT of ``ttft_per_active_s x in-flight`` is exactly that.

Use the ``virtual_time`` fixture (import it into the test module)::

    from tests.unit.virtual_time import virtual_time  # noqa: F401

    def test_x(virtual_time):
        with virtual_time.server(FakeBehavior(first_token_delay_s=0.2)) as srv:
            run_replay(wl, srv.url, ...)          # srv.state: the fake's requests, as usual

Scope: ``kvtier.client.stream`` and ``kvtier.client.replay`` read the virtual clock (their
``time.perf_counter``), ``kvtier.client.replay.make_http_client`` gets the in-process transport,
and ``asyncio.run`` makes virtual-time loops, for the test's duration only. A URL that no virtual
server answers (or one that was stopped) is a connection error, as with a real socket.
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.unit.fake_openai_server import FakeBehavior, FakeState, build_app

_EPOCH = 1.8e9                      # wall-clock seconds at virtual time 0 (for ``time.time()`` users)


class VirtualClock:
    """Seconds since the start of the test; moved only by ``advance`` (the loops below)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds

    def module(self) -> SimpleNamespace:
        """A stand-in for the ``time`` module of code under test."""
        return SimpleNamespace(perf_counter=self, monotonic=self, time=lambda: _EPOCH + self.now,
                               sleep=self.advance)


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks on timers: when nothing is ready, the clock jumps by the loop's timeout."""

    def __init__(self, loop: "VirtualLoop") -> None:
        super().__init__()
        self._vloop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if self._vloop.threads_busy:          # executor work in flight: wait for it in real time
            return super().select(0.05 if timeout is None else min(timeout, 0.05))
        if timeout is None:
            raise RuntimeError("virtual time: the event loop would wait forever (nothing scheduled)")
        self._vloop.clock.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a ``VirtualClock``."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.threads_busy = 0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(self, executor, func, *args):
        fut = super().run_in_executor(executor, func, *args)
        self.threads_busy += 1

        def done(_: Any) -> None:
            self.threads_busy -= 1
        fut.add_done_callback(done)
        return fut


class VirtualPolicy(asyncio.DefaultEventLoopPolicy):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return VirtualLoop(self.clock)


class _Body(httpx.AsyncByteStream):
    def __init__(self, queue: asyncio.Queue, task: asyncio.Task, disconnected: asyncio.Event) -> None:
        self._queue, self._task, self._disconnected = queue, task, disconnected

    async def __aiter__(self):
        while True:
            msg = await self._queue.get()
            if msg is None:                                   # the app ended without finishing the body
                raise httpx.RemoteProtocolError("server closed the connection mid-response")
            if msg.get("body"):
                yield msg["body"]
            if not msg.get("more_body", False):
                return

    async def aclose(self) -> None:
        self._disconnected.set()
        if not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class InProcessTransport(httpx.AsyncBaseTransport):
    """httpx -> the ASGI app registered for the request's host:port, streamed chunk by chunk."""

    def __init__(self) -> None:
        self.apps: dict[str, Any] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        app = self.apps.get(request.url.netloc.decode())
        if app is None:
            raise httpx.ConnectError(f"connection refused: {request.url.netloc.decode()}", request=request)
        body = await request.aread()
        queue: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            await queue.put(msg)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": request.url.scheme, "path": request.url.path, "raw_path": request.url.raw_path,
                 "query_string": request.url.query, "root_path": "",
                 "headers": [(k.lower(), v) for k, v in request.headers.raw],
                 "client": ("127.0.0.1", 50000), "server": (request.url.host, request.url.port or 80)}

        async def run() -> None:
            try:
                await app(scope, receive, send)
            finally:
                await queue.put(None)

        task = asyncio.create_task(run())
        start = await queue.get()
        if start is None or start["type"] != "http.response.start":
            await asyncio.gather(task, return_exceptions=True)
            raise httpx.RemoteProtocolError("server closed the connection without a response", request=request)
        return httpx.Response(start["status"], headers=start.get("headers", []),
                              stream=_Body(queue, task, disconnected), request=request)


class VirtualServer:
    """A fake OpenAI server on the in-process transport (``FakeOpenAIServer``'s interface)."""

    def __init__(self, transport: InProcessTransport, host: str, behavior: FakeBehavior) -> None:
        self.state = FakeState(behavior)
        self._transport, self._host = transport, host
        transport.apps[host] = build_app(self.state)

    @property
    def url(self) -> str:
        return f"http://{self._host}"

    @property
    def behavior(self) -> FakeBehavior:
        return self.state.behavior

    def stop(self) -> None:
        self._transport.apps.pop(self._host, None)

    def __enter__(self) -> "VirtualServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VirtualTime:
    """What the fixture yields: the clock and a factory of virtual fake servers."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.transport = InProcessTransport()
        self._ports = itertools.count(18000)

    def server(self, behavior: FakeBehavior | None = None) -> VirtualServer:
        return VirtualServer(self.transport, f"fake.invalid:{next(self._ports)}", behavior or FakeBehavior())

    def http_client(self, base_url: str, opts: Any) -> httpx.AsyncClient:
        """``kvtier.client.stream.make_http_client`` on the in-process transport."""
        return httpx.AsyncClient(base_url=base_url, transport=self.transport,
                                 timeout=httpx.Timeout(opts.request_timeout_s, connect=opts.connect_timeout_s))


@pytest.fixture
def virtual_time(monkeypatch) -> VirtualTime:
    """Patch the bench modules and asyncio for the test (all undone afterwards)."""
    import kvtier.client.stream as client
    import kvtier.client.replay as replay
    import tests.unit.fake_openai_server as fake

    vt = VirtualTime()
    clock_time = vt.clock.module()
    for mod in (client, replay, fake):
        monkeypatch.setattr(mod, "time", clock_time)
    monkeypatch.setattr(replay, "make_http_client", vt.http_client)
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(VirtualPolicy(vt.clock))
    try:
        yield vt
    finally:
        asyncio.set_event_loop_policy(old)
