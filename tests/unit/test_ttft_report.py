"""`kvtier bench ttft` reporting pieces that need no engine: ratios, Markdown/JSON, CPU meter."""

from __future__ import annotations

import json

from kvtier.bench.ttft import CpuMeter, TtftReport, TtftRow, kvtier_bench_config, report_json, report_markdown


def _report() -> TtftReport:
    r = TtftRow(8192, vanilla_s=40.0, apc_hit_s=1.0, kvtier_miss_s=41.0, kvtier_ram_s=1.1, kvtier_ssd_s=1.5,
                example_connector_s=None, example_connector_error="exit 1: RuntimeError: shape mismatch",
                kv_bytes=1000, ideal_ssd_s=1.25, miss_overhead_ratio=41.0 / 40.0, ssd_vs_ideal=1.2)
    return TtftReport(command="kvtier bench ttft", machine={"cpus": 2}, model="/m/SmolLM2", dtype="float32",
                      repeats=3, disk_read_bytes_per_s=1e9, rows=[r], crashes={"example-r": "exit 1: boom"},
                      kvtier_config=kvtier_bench_config("<workdir>/kvtier"),
                      load={"wall_s": 10.0, "other_processes_cpu_s": 0.5, "other_processes_cores_avg": 0.05})


def test_markdown_has_every_column_the_config_and_the_load() -> None:
    md = report_markdown(_report())
    row = next(line for line in md.splitlines() if line.startswith("| 8192"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["8192", "40.000", "1.000", "41.000", "1.100", "1.500", "1.250", "1.20", "crashed", "—", "1.025"]
    assert '"chunk_size": 256' in md and "other_processes_cpu_s=0.5" in md and "`example-r`: exit 1: boom" in md


def test_json_keys_per_prompt_length() -> None:
    d = json.loads(json.dumps(report_json(_report())))
    row = d["per_prompt_length"]["8192"]
    for k in ("vanilla_s", "apc_hit_s", "kvtier_ram_s", "kvtier_ssd_s", "example_connector_s", "ideal_ssd_s",
              "miss_overhead_ratio"):
        assert k in row
    assert row["example_connector_s"] is None and d["kvtier_config"]["store"]["disk"]["enabled"] is True


def test_cpu_meter_counts_only_other_processes() -> None:
    m = CpuMeter()
    x = 0
    for i in range(2_000_000):      # our own CPU time must not show up as "other processes"
        x += i
    s = m.summary()
    assert set(s) == {"wall_s", "other_processes_cpu_s", "other_processes_cores_avg"}
    assert s["other_processes_cpu_s"] >= 0
