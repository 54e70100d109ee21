"""The cluster demo's figures from a synthetic result (kvtier.demo.cluster_report): per-run entry,
targets, JSON schema, Markdown + plots."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from kvtier.client.server_metrics import MetricsSnapshot
from kvtier.client.stream import RequestRecord
from kvtier.client.summary import summarize
from kvtier.demo.cluster_report import build_document, check_targets, run_figures, tier_tokens, write_report
from kvtier.demo.cluster_sizing import Capacities

CAPS = Capacities(kv_cache_tokens=1152, ram_tokens=512, ssd_tokens=1536, shared_tokens=8192, working_set_tokens=3000,
                  kv_bytes_per_token=100)


def _rec(cid: str, turn: int, replica: str, prompt: int, cached: int, ttft: float) -> RequestRecord:
    return RequestRecord(conversation_id=cid, turn=turn, api="chat", start_s=float(turn), ttft_s=ttft, e2e_s=ttft + 0.1,
                         prompt_tokens=prompt, cached_tokens=cached, output_tokens=4, replica=replica)


def _snap(gpu: float, memory: float = 0, disk: float = 0, shared: float = 0, timeouts: float = 0) -> MetricsSnapshot:
    s = {"vllm:prefix_cache_hits_total": gpu, "kvtier_connector_hit_tokens_total{tier=memory}": memory,
         "kvtier_connector_hit_tokens_total{tier=disk}": disk, "kvtier_connector_hit_tokens_total{tier=shared}": shared}
    if timeouts:
        s["kvtier_events_total{kind=shared_timeout}"] = timeouts
    return MetricsSnapshot(s)


def _result(config: str, routing: str, recs: list[RequestRecord], after: dict[str, MetricsSnapshot]) -> dict:
    return {"config": config, "routing": routing, "records": recs, "summary": summarize(recs, duration_s=10.0),
            "before": {"r0": _snap(100), "r1": _snap(50)}, "after": after, "replicas": ["r0", "r1"],
            "router": None, "concurrency": 4, "think_time_scale": 0.1, "wall_s": 10.0, "ideal": 0.6}


def _shared_rr() -> dict:
    recs = [_rec("a", 0, "r0", 400, 0, 2.0), _rec("a", 1, "r1", 500, 384, 1.0), _rec("b", 0, "r1", 400, 0, 2.0),
            _rec("b", 1, "r0", 500, 256, 1.2)]
    return _result("shared", "roundrobin", recs, {"r0": _snap(100 + 128, shared=128), "r1": _snap(50, shared=256, memory=128,
                                                                                                    timeouts=2)})


def test_run_entry_has_the_validation_schema_and_per_replica_figures():
    r = run_figures(_shared_rr(), CAPS.to_dict(), 0.6)
    for key in ("config", "routing", "token_hit_rate", "ideal_hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
                "requests", "per_replica", "tier_tokens", "computed_tokens_per_request", "capacities", "load"):
        assert key in r
    assert r["token_hit_rate"] == (384 + 256) / 1800
    assert r["hit_rate_vs_ideal"] == r["token_hit_rate"] / 0.6
    assert r["tier_tokens"] == {"gpu": 128, "ram": 128, "ssd": 0, "shared": 384}
    r0, r1 = r["per_replica"]
    assert (r0["name"], r0["requests"], r0["token_hit_rate"]) == ("r0", 2, 256 / 900)
    assert r1["tier_tokens"] == {"gpu": 0, "ram": 128, "ssd": 0, "shared": 256}
    assert r["shared_events"] == {"shared_timeout": 2}
    assert r["capacities"] == {"kv_cache_tokens": 1152, "ram_bytes": 51200, "ssd_bytes": 153600, "shared_bytes": 819200}
    assert r["load"] == {"mode": "closed", "concurrency": 4, "think_time_scale": 0.1}


def test_capacities_follow_the_configuration():
    res = _shared_rr()
    assert run_figures({**res, "config": "local"}, CAPS.to_dict(), 0.6)["capacities"]["shared_bytes"] == 0
    van = run_figures({**res, "config": "vanilla"}, CAPS.to_dict(), 0.6)["capacities"]
    assert (van["ram_bytes"], van["ssd_bytes"], van["shared_bytes"]) == (0, 0, 0)


def test_tier_tokens_are_deltas():
    assert tier_tokens(_snap(10, 1, 2, 3), _snap(30, 5, 2, 10)) == {"gpu": 20, "ram": 4, "ssd": 0, "shared": 7}


def _entry(config, routing, hit, ideal, ttft):
    return {"config": config, "routing": routing, "token_hit_rate": hit, "ideal_hit_rate": ideal,
            "hit_rate_vs_ideal": hit / ideal, "ttft_mean_s": ttft}


def test_targets_met_and_missed():
    runs = [_entry("local", "roundrobin", 0.40, 0.60, 1.5), _entry("local", "sticky", 0.55, 0.60, 1.0),
            _entry("shared", "roundrobin", 0.57, 0.60, 1.05), _entry("shared", "sticky", 0.56, 0.60, 1.0)]
    t = check_targets(runs)
    assert t["shared_rr_reaches_90pct_of_ideal"] is True
    assert round(t["shared_rr_margin_over_local_rr_points"], 6) == 17.0
    assert t["shared_rr_ttft_within_10pct_of_local_sticky"] is True
    assert [x["routing"] for x in t["shared_does_not_help"]] == ["sticky"]
    runs[2] = _entry("shared", "roundrobin", 0.45, 0.60, 1.3)
    t = check_targets(runs)
    assert t["shared_rr_reaches_90pct_of_ideal"] is False
    assert t["shared_rr_ttft_within_10pct_of_local_sticky"] is False


def test_document_and_report(tmp_path: Path):
    plan = SimpleNamespace(capacities=CAPS, workload="companion", history="live", size={"conversations": 2},
                           predicted={"local/roundrobin": 0.4, "local/sticky": 0.55, "ideal": 0.6})
    cal = SimpleNamespace(to_dict=lambda: {"profile": {"a": 1.0}, "startup_s": 40.0})
    opts = SimpleNamespace(replicas=2, calibration=None, shared="juicefs", quick=True)
    facts = SimpleNamespace(dtype="float32")
    res = [_shared_rr(), {**_shared_rr(), "config": "local"}]
    doc = build_document(plan, cal, facts, opts, tmp_path / "companion.jsonl", res, [], 60.0, 70.0)
    assert doc["replicas"] == 2 and doc["workload"].endswith("companion.jsonl")
    assert doc["calibration"].endswith("calibration.json") and "cpu" in doc["machine"] or "cpus" in doc["machine"]
    assert [(r["config"], r["routing"]) for r in doc["runs"]] == [("shared", "roundrobin"), ("local", "roundrobin")]
    json.dumps(doc)                                        # JSON-able as it is
    path = write_report(doc, tmp_path)
    text = path.read_text()
    assert "| shared/roundrobin |" in text and "| local/roundrobin |" in text
    # predicted beside measured: the curves' prediction for the runs that have one
    assert "| predicted hit | hit rate |" in text and "| local/roundrobin | 4/0 | 40.0% | 35.6% |" in text
    assert "of the single-machine ideal" in text
    assert (tmp_path / "hit_rate.png").stat().st_size > 0 and (tmp_path / "ttft_tiers.png").stat().st_size > 0
