"""A real Mooncake Store for tests: ``mooncake_master`` (with its built-in HTTP metadata server)
plus a standalone pool-owner client that mounts the memory segment, TCP transport, 127.0.0.1 only.

    mc = MooncakeCluster.start(tmp_path, segment_bytes=256 << 20)
    mc.master_addr       # "127.0.0.1:PORT"   (MooncakeConfig.master)
    mc.metadata_url      # "http://127.0.0.1:PORT/metadata"  (MooncakeConfig.metadata_server)
    mc.pause()           # SIGSTOP master + pool owner (a stalled store); mc.resume()
    mc.kill_master(); mc.restart_master()   # the master's metadata is in memory: objects are gone after
    mc.kill_owner(); mc.restart_owner()     # the segment vanishes with its owner
    mc.stop()
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.ports import free_port
from kvtier.services._proc import (HOST, ServiceMissing, kill_proc, port_open, signal_proc, spawn,
                                  stop_proc, wait_until)

_HINT = "pip install mooncake-transfer-engine-non-cuda (the `services` extra) and apt-get install libibverbs1"


def master_binary() -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceMissing(f"python package mooncake not installed: {_HINT}")
    for loc in spec.submodule_search_locations:
        cand = Path(loc) / "mooncake_master"
        if cand.exists():
            return str(cand)
    raise ServiceMissing(f"mooncake_master binary not found in the mooncake package: {_HINT}")


@dataclass
class MooncakeCluster:
    root: Path
    rpc_port: int
    http_port: int
    metrics_port: int
    segment_bytes: int
    lease_ttl_ms: int
    master: subprocess.Popen | None = None
    owner: subprocess.Popen | None = None
    extra_master_args: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, tmp: Path, segment_bytes: int = 256 * 2**20, lease_ttl_ms: int = 2000,
              extra_master_args: tuple[str, ...] = (), timeout: float = 30.0) -> "MooncakeCluster":
        master_binary()
        ports = [free_port() for _ in range(3)]
        root = Path(tmp).resolve() / f"mooncake-{ports[0]}"
        root.mkdir(parents=True, exist_ok=True)
        mc = cls(root=root, rpc_port=ports[0], http_port=ports[1], metrics_port=ports[2],
                 segment_bytes=segment_bytes, lease_ttl_ms=lease_ttl_ms, extra_master_args=list(extra_master_args))
        try:
            mc.restart_master(timeout)
            mc.restart_owner(timeout)
        except BaseException:
            mc.stop()
            raise
        return mc

    @property
    def master_addr(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    def restart_master(self, timeout: float = 30.0) -> None:
        stop_proc(self.master)
        argv = [master_binary(), f"--rpc_port={self.rpc_port}", f"--rpc_address={HOST}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                f"--http_metadata_server_port={self.http_port}", f"--metrics_host={HOST}",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                "--client_ttl=5", *self.extra_master_args]
        log = self.root / "master.log"
        self.master = spawn(argv, log)
        wait_until(lambda: port_open(self.rpc_port) and port_open(self.http_port), timeout,
                   "mooncake_master", self.master, log)

    def restart_owner(self, timeout: float = 30.0) -> None:
        stop_proc(self.owner)
        log = self.root / "owner.log"
        log.write_text("")
        argv = [sys.executable, "-m", "tests.services.mooncake_pool_owner", "--master", self.master_addr,
                "--metadata", self.metadata_url, "--segment", str(self.segment_bytes)]
        self.owner = spawn(argv, log)
        wait_until(lambda: "READY" in log.read_text(errors="replace"), timeout, "mooncake pool owner",
                   self.owner, log)

    def key_count(self) -> int:
        """Objects the master knows (its ``master_key_count`` metric); -1 if it does not answer."""
        import urllib.request

        try:
            text = urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return -1
        for line in text.splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
        return -1

    def pause(self) -> None:
        """SIGSTOP the master and the pool owner: RPCs and transfers stall (sockets stay open)."""
        signal_proc(self.master, signal.SIGSTOP)
        signal_proc(self.owner, signal.SIGSTOP)

    def resume(self) -> None:
        signal_proc(self.owner, signal.SIGCONT)
        signal_proc(self.master, signal.SIGCONT)

    def kill_master(self) -> None:
        kill_proc(self.master)

    def kill_owner(self) -> None:
        kill_proc(self.owner)

    def stop(self) -> None:
        stop_proc(self.owner)
        stop_proc(self.master)
