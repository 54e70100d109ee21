"""A real HAProxy in front of N OpenAI-compatible replicas on 127.0.0.1 (Debian package ``haproxy``).

Two balancing modes (``BALANCE_MODES``):

* ``roundrobin``: what a plain balancer does, each request to the next healthy replica;
* ``sticky``: by conversation, ``balance hdr(<header>)`` with ``hash-type consistent``: the client
  sends one header value per conversation (``CONVERSATION_HEADER``), every turn of it lands on the
  same replica while that replica is up, and a dead replica's conversations move to the others
  (consistent hashing moves only those).

Every response carries ``SERVED_BY_HEADER`` = the name of the replica that served it (``r0``,
``r1`` ...), so a client can count requests per replica. Health checks (``GET /health`` every
``check_interval_ms``) take a dead replica out; ``option redispatch`` + ``retries`` resend a
request whose connection was refused to another replica. Timeouts are long: a CPU prefill takes
seconds.

``render_config`` is pure (the text of the config file); ``check_config`` runs ``haproxy -c -f``;
``Haproxy.start`` writes the file, starts ``haproxy -db`` (foreground) in its own process group,
waits for the port; ``stop()`` is idempotent and never raises.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvtier.ports import free_port
from kvtier.services._proc import HOST, ServiceMissing, port_open, spawn, stop_proc, wait_until

BALANCE_MODES = ("roundrobin", "sticky")
CONVERSATION_HEADER = "X-Conversation-Id"
SERVED_BY_HEADER = "X-Kvtier-Replica"
_HINT = "apt-get install haproxy (scripts/setup.sh does it)"


class HaproxyError(RuntimeError):
    """Bad balancer settings, or HAProxy refused its config / did not start (the message says why)."""


@dataclass(frozen=True)
class Backend:
    """One replica behind the balancer."""

    name: str
    port: int
    host: str = HOST


@dataclass(frozen=True)
class BalancerSpec:
    """What the balancer does: listen port, mode, replicas and health-check pace."""

    port: int
    mode: str
    backends: tuple[Backend, ...]
    header: str = CONVERSATION_HEADER
    check_interval_ms: int = 1000
    timeout_s: int = 900
    retries: int = 3

    def validate(self) -> None:
        if self.mode not in BALANCE_MODES:
            raise HaproxyError(f"unknown balance mode {self.mode!r} (one of: {', '.join(BALANCE_MODES)})")
        if not self.backends:
            raise HaproxyError("the balancer needs at least one replica")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise HaproxyError(f"replica names must be distinct, got {names}")
        for b in self.backends:
            if not b.name.replace("-", "").replace("_", "").isalnum():
                raise HaproxyError(f"replica name {b.name!r} must be letters, digits, - or _")
            if not 1 <= b.port <= 65535:
                raise HaproxyError(f"replica {b.name}: port {b.port} is not in 1..65535")
        if not 1 <= self.port <= 65535:
            raise HaproxyError(f"balancer port {self.port} is not in 1..65535")
        if not self.header.replace("-", "").isalnum():
            raise HaproxyError(f"header {self.header!r} must be letters, digits and -")


def render_config(spec: BalancerSpec, pidfile: Path | None = None) -> str:
    """The HAProxy config text for ``spec`` (pure; raises HaproxyError on bad settings)."""
    spec.validate()
    balance = "balance roundrobin" if spec.mode == "roundrobin" else f"balance hdr({spec.header})\n    hash-type consistent"
    lines = ["global", "    maxconn 1024", "    log stderr format short local0 warning"]
    if pidfile is not None:
        lines.append(f"    pidfile {pidfile}")
    lines += ["", "defaults", "    mode http", "    log global", "    option redispatch", f"    retries {spec.retries}",
              "    timeout connect 2s", f"    timeout client {spec.timeout_s}s", f"    timeout server {spec.timeout_s}s",
              "    timeout http-request 30s", "",
              "frontend kvtier_cluster", f"    bind {HOST}:{spec.port}", "    default_backend replicas", "",
              "backend replicas", f"    {balance}", "    option httpchk GET /health",
              f"    http-response set-header {SERVED_BY_HEADER} %s"]
    for b in spec.backends:
        lines.append(f"    server {b.name} {b.host}:{b.port} check inter {spec.check_interval_ms}ms fall 2 rise 1")
    return "\n".join(lines) + "\n"


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/sbin"))
    if not found:
        raise ServiceMissing(f"haproxy not found: {_HINT}")
    return found


def check_config(path: Path, binary: str | None = None) -> None:
    """``haproxy -c -f path``; HaproxyError with HAProxy's own complaint when it refuses the file."""
    out = subprocess.run([binary or haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True,
                         timeout=30)
    if out.returncode != 0:
        raise HaproxyError(f"haproxy refused {path}: {(out.stdout + out.stderr).strip()[-600:]}")


@dataclass
class Haproxy:
    """A running balancer (``Haproxy.start``); ``url`` is what clients talk to."""

    spec: BalancerSpec
    config_path: Path
    log: Path
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.spec.port}"

    @classmethod
    def start(cls, workdir: Path, mode: str, backends: Sequence[Backend], port: int | None = None,
              check_interval_ms: int = 1000, timeout: float = 20.0) -> "Haproxy":
        binary = haproxy_binary()
        spec = BalancerSpec(port=port or free_port(), mode=mode, backends=tuple(backends),
                            check_interval_ms=check_interval_ms)
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = workdir / f"haproxy-{mode}.cfg"
        cfg.write_text(render_config(spec))
        check_config(cfg, binary)
        log = workdir / f"haproxy-{mode}.log"
        proc = spawn([binary, "-db", "-f", str(cfg)], log)
        lb = cls(spec=spec, config_path=cfg, log=log, proc=proc)
        try:
            wait_until(lambda: port_open(spec.port), timeout, f"haproxy on {HOST}:{spec.port}", proc, log)
        except BaseException:
            lb.stop()
            raise
        return lb

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (then SIGKILL) and reap; idempotent, never raises."""
        try:
            stop_proc(self.proc)
        except Exception:
            pass

    def __enter__(self) -> "Haproxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
