"""`kvtier bench ttft --slow-tier` pieces that need no engine: the latency sizing, the rows and their
checks from engine results, the reader configs, the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.ttft_slow import SlowTierReport, _row, report_json, report_markdown, slow_latency_ms
from kvtier.bench.ttft_slow_engine import reader_config, role_config
from kvtier.config import KvtierConfig


def test_latency_makes_the_whole_load_twice_the_compute():
    # 1,024 tokens cold in 4 s, 896 in the hit: 4 chunks, 2 reads in flight -> query + 2 rounds of reads
    ms = slow_latency_ms(4.0, 1024, 896, 256)
    assert 3 * ms / 1000 == pytest.approx(2 * 4.0 * 896 / 1024)
    assert slow_latency_ms(4.0, 1024, 896, 256, in_flight=4) == pytest.approx(1.5 * ms)


def test_reader_configs_are_valid_and_only_the_slow_one_is_slowed(tmp_path: Path):
    slow = KvtierConfig.model_validate(role_config("slow:pays-off", tmp_path, 2500))
    fast = KvtierConfig.model_validate(role_config("fast:always", tmp_path, 2500))
    assert slow.store.faults.wraps == "shared" and slow.store.faults.latency_ms == 2500
    assert slow.claims.policy == "pays-off" and fast.claims.policy == "always"
    assert fast.store.faults is None and not fast.store.disk.enabled and not fast.connector.save
    assert role_config("recompute:1", tmp_path, 2500) is None
    assert str(fast.store.shared.path) == str(tmp_path / "shared")
    assert KvtierConfig.model_validate(reader_config(tmp_path, "always", 0)).store.shared.janitor is False


def _hit(s: float, loaded: int, declined: int = 0) -> dict:
    delta = {"kvtier_connector_loaded_tokens_total": float(loaded)}
    if loaded:
        delta["kvtier_store_hits_total{tier=sharedfs}"] = 4.0
    if declined:
        delta["kvtier_claims_declined_total{reason=slow,tier=shared}"] = float(declined)
    return {"s": s, "cached": loaded, "reset_ok": True, "kvtier": delta}


def _runs(pays_off_loads: bool) -> dict:
    cold = [{"s": 4.0, "cached": 0}, {"s": 4.2, "cached": 0}]
    reader = {"teach": {"s": 4.5}, "probe": {"s": 9.0}, "cold": [{"s": 4.0, "cached": 0}, {"s": 4.2, "cached": 0}]}
    return {
        "recompute:1": {"rows": {"1024": {"cold": cold[:1]}}},
        "recompute:2": {"rows": {"1024": {"cold": cold[1:]}}},
        "writer": {"rows": {"1024": {"cold": [{"s": 4.4, "cached": 0}]}}},
        "slow:always": {"rows": {"1024": {**reader, "hit": [_hit(8.0, 896), _hit(8.4, 896)]}}},
        "slow:pays-off": {"rows": {"1024": {**reader, "hit": [_hit(4.1, 896 if pays_off_loads else 0,
                                                                   0 if pays_off_loads else 1)] * 2}}},
        "fast:always": {"rows": {"1024": {**reader, "hit": [_hit(0.5, 896)] * 2}}},
        "fast:pays-off": {"rows": {"1024": {**reader, "hit": [_hit(0.6, 896)] * 2}}},
    }


def test_rows_give_ratios_against_recompute_and_what_each_request_did():
    bad: list[str] = []
    row = _row(1024, _runs(False), 256, 128, bad)
    assert bad == []
    assert row.recompute_s == pytest.approx(4.1) and row.kvtier_miss_s == 4.4
    slow = row.configs["slow:always"]
    assert slow.ttft_s == pytest.approx(8.2) and slow.vs_recompute == pytest.approx(8.2 / 4.1)
    po = row.configs["slow:pays-off"]
    assert po.loaded_tokens == [0, 0] and po.declined_chunks == [1, 1] and po.vs_recompute == pytest.approx(1.0)
    assert row.configs["fast:pays-off"].probe_s == 9.0
    md = report_markdown(SlowTierReport("kvtier bench ttft --slow-tier", {"cpus": 2}, "m", "float32", 2, 2600.0,
                                        "sized", 2048, rows=[row]))
    assert po.cold_here_s == pytest.approx(4.1) and po.vs_cold_here == pytest.approx(1.0)
    assert "| slow tier, claims pays-off | 4.100 | 1.00 | 4.100 | 1.00 | 0.93 | [0, 0] | [1, 1] |" in md
    assert "2600 ms" in md and "ROWS THAT" not in md
    assert report_json(SlowTierReport("c", {}, "m", "f", 1, 0.0, "", 1, rows=[row]))["rows"][0]["hit_tokens"] == 896


def test_an_always_row_that_did_not_load_from_the_tier_is_a_violation():
    runs = _runs(False)
    runs["slow:always"]["rows"]["1024"]["hit"] = [_hit(4.0, 0)]
    bad: list[str] = []
    _row(1024, runs, 256, 128, bad)
    assert bad and all(v.startswith("slow:always 1024") for v in bad)
    ok: list[str] = []
    _row(1024, _runs(True), 256, 128, ok)               # pays-off may load: the policy decides
    assert ok == []
