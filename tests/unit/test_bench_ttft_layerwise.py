"""``kvtier bench ttft --layerwise``: figures and checks from engine samples (no engine)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtier.bench.ttft_layerwise import report_markdown, summarize

CHUNK = 256


def _hit(s: float, tokens: int, *, load: float, wait: float, disk_reads: int | None = None) -> dict:
    reads = tokens // CHUNK if disk_reads is None else disk_reads
    return {"s": s, "cached": tokens, "reset_ok": True, "load": {"total": load, "wait": wait, "read": 0, "copy": 0},
            "kvtier": {"kvtier_connector_loaded_tokens_total": float(tokens),
                       "kvtier_store_hits_total{tier=disk}": float(reads)}}


def _raw(n: int, **hit_kw) -> dict:
    return {"cold": [{"s": 8.0, "cached": 0, "kvtier": {"kvtier_connector_save_seconds_sum": 0.05}}],
            "whole": [_hit(1.3, n, load=0.1, wait=0.04), _hit(1.1, n, load=0.08, wait=0.03)],
            "layerwise": [_hit(1.25, n, load=1.2, wait=0.02, **hit_kw), _hit(1.15, n, load=1.1, wait=0.03)],
            "compute": [{"s": 1.0, "cached": n}, {"s": 1.2, "cached": n}, {"s": 1.1, "cached": n}]}


def test_ratios_are_against_the_larger_of_load_alone_and_compute_alone():
    row, bad = summarize(2048, 256, _raw(2048), CHUNK)
    assert bad == []
    assert row.load_alone_s == 0.09 and row.compute_alone_s == 1.1      # medians
    assert row.whole_s == pytest.approx(1.2) and row.layerwise_s == pytest.approx(1.2)
    assert row.layerwise_vs_bound == pytest.approx(1.2 / 1.1) and row.layerwise_vs_whole == pytest.approx(1.0)
    assert row.layerwise_wait_s == pytest.approx(0.025) and row.cold_save_s == 0.05
    assert "2048 + 256" in report_markdown(_report(row))


def test_a_hit_not_read_from_the_disk_tier_is_a_violation():
    _, bad = summarize(2048, 256, _raw(2048, disk_reads=3), CHUNK)
    assert len(bad) == 1 and bad[0].startswith("layerwise 2048") and "disk tier" in bad[0]


def test_compute_alone_must_find_the_prefix_in_vllms_cache():
    raw = _raw(1024)
    raw["compute"][0]["cached"] = 0
    _, bad = summarize(1024, 256, raw, CHUNK)
    assert bad == ["compute 1024: vLLM's prefix cache held 0 tokens, expected the prefix"]


def test_cli_refuses_lengths_that_are_not_whole_chunks():
    import typer

    from kvtier.commands import ttft_cmd

    app = typer.Typer()
    ttft_cmd.register(app)
    app.command("other")(lambda: None)          # a group: the command is invoked by its name
    res = CliRunner().invoke(app, ["ttft", "--layerwise", "--lengths", "1000"])
    text = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "multiples of the 256-token chunk" in text


def _report(row):
    from kvtier.bench.ttft_layerwise import LayerwiseReport

    return LayerwiseReport("kvtier bench ttft --layerwise", {"cpu": "test"}, "m", "float32", 2, 2048, {}, [row])
