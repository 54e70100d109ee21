"""What the companion demo's console says: the replies as sent, and a RAM-only speedup outside the
published band (or not below RAM+SSD) first in the summary and in the report's headline figures."""

from __future__ import annotations

from pathlib import Path

from kvtier.demo.companion import band_line, reply_words
from kvtier.demo.companion_report import append_figures_section
from kvtier.demo.sizing import TurnFacts, WorkloadFacts


def _facts(outs: list[list[int]]) -> WorkloadFacts:
    convs = tuple(tuple(TurnFacts(300, 0, 1.0, o) for o in c) for c in outs)
    n = sum(len(c) for c in convs)
    return WorkloadFacts(requests=n, prompt_tokens=300 * n, ideal_hit_tokens=0, think_s=0.0, max_prompt_tokens=300,
                         conversations=convs)


def test_the_size_line_states_the_reply_length_actually_sent():
    f = _facts([[14, 20], [16]])
    assert reply_words(f, "live", 8) == "replies of 16.7 tokens on average (max_tokens 14-20)"
    assert f.mean_reply_tokens == (14 + 20 + 16) / 3
    # workload history sends the size's max_tokens with every request
    assert reply_words(f, "workload", 8) == "replies of 8 tokens (max_tokens)"


def test_a_ram_only_speedup_outside_the_band_or_not_below_ram_ssd_is_said():
    # the AVX2 run of 2026-12-07: RAM-only 2.67x, RAM+SSD 2.67x
    line = band_line(2.6656, 2.6651)
    assert "outside the published band 1.2-1.8x" in line and "not below RAM+SSD" in line
    assert band_line(1.10, 2.0) == "RAM-only 1.10x is outside the published band 1.2-1.8x"
    assert band_line(1.39, 2.45) is None and band_line(None, 2.0) is None


def _figures(band: str | None) -> dict:
    c = {"returning_turns": None}
    return {"history": "live", "users": 8, "speedup_mean_ttft": 2.67, "ram_only_speedup": 2.67, "token_hit_rate": 0.75,
            "hit_rate_vs_ideal": 0.99, "ideal_hit_rate": 0.754, "ideal_hit_rate_prompts": 0.73,
            "compared": {"vanilla": c, "kvtier-ram": c, "kvtier-ram-ssd": c}, "ram_only_band_missed": band}


def test_the_reports_headline_figures_start_with_a_missed_band(tmp_path: Path):
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    append_figures_section(report, _figures(band_line(2.67, 2.67)))
    lines = [x for x in report.read_text().splitlines() if x.startswith("- ")]
    assert lines[0].startswith("- **not the published regime on this run: RAM-only 2.67x is outside")
    report.write_text("# report\n")
    append_figures_section(report, _figures(None))
    assert "not the published regime" not in report.read_text()
