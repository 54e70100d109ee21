"""`kvtier bench ttft` reporting pieces that need no engine: ratios, Markdown/JSON, CPU meter."""

from __future__ import annotations

import json

from kvtier.bench.ttft import CpuMeter
from kvtier.bench.ttft_engine import kvtier_bench_config
from kvtier.bench.ttft_report import report_json, report_markdown
from kvtier.bench.ttft_result import TtftReport, TtftRow


def _report() -> TtftReport:
    r = TtftRow(8192, vanilla_s=40.0, apc_hit_s=1.0, kvtier_miss_s=41.0, kvtier_ram_s=1.1, kvtier_ssd_s=1.5,
                example_connector_s=None, example_connector_error="exit 1: RuntimeError: shape mismatch",
                kv_bytes=1000, ideal_ssd_s=1.25, miss_overhead_ratio=41.0 / 40.0, ssd_vs_ideal=1.2)
    low = TtftRow(1024, kvtier_ssd_s=0.1, ideal_ssd_s=0.2, ssd_vs_ideal=0.5, ideal_not_a_bound=True,
                  peers_hit_s={"OffloadingConnector": 0.3})
    return TtftReport(command="kvtier bench ttft", machine={"cpus": 2}, model="/m/SmolLM2", dtype="float32",
                      repeats=3, raw_read={"reads_in_flight": 8, "piece_bytes": 2 << 20, "o_direct": True,
                                           "tries": 3, "bytes_per_s": 1e9},
                      rows=[r, low], crashes={"example-r": "exit 1: boom"}, block_size=128, chunk_size=256,
                      kvtier_config=kvtier_bench_config("<workdir>/kvtier"),
                      load={"wall_s": 10.0, "other_processes_cpu_s": 0.5, "other_processes_cores_avg": 0.05})


def test_markdown_has_every_column_the_config_and_the_load() -> None:
    md = report_markdown(_report())
    row = next(line for line in md.splitlines() if line.startswith("| 8192"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["8192", "40.000", "1.000", "41.000", "1.100", "1.500", "1.250", "1.20", "failed", "—", "1.025",
                     "—"]
    assert '"chunk_size": 256' in md and "other_processes_cpu_s=0.5" in md and "`example-r`: exit 1: boom" in md
    assert "8 reads of 2048 KiB in flight" in md and "O_DIRECT=True" in md and "block size 128" in md
    low = next(line for line in md.splitlines() if line.startswith("| 1024"))
    assert "0.50 (ideal not a bound!)" in low and low.rstrip().endswith("0.300 |")   # the peer's column


def test_a_row_that_did_not_load_what_it_claims_fails_the_run() -> None:
    import pytest

    from kvtier.bench.ttft_result import TtftCheckFailed, check_report

    rep = _report()
    check_report(rep)                   # no violations: fine
    rep.violations.append("kvtier-r: ssd_hit 1024: 0 chunk reads served by the disk tier, expected 3")
    assert "DID NOT LOAD WHAT THEY CLAIM" in report_markdown(rep)
    with pytest.raises(TtftCheckFailed, match="served by the disk tier"):
        check_report(rep)


def test_error_line_is_the_root_cause_not_the_wrapper() -> None:
    from kvtier.bench.ttft import error_line

    log = ("INFO starting\nTraceback (most recent call last):\n"
           "AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert error_line(log).startswith("AttributeError: type object '_StreamPlaceholder'")
    assert error_line("") == "no output"


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
