"""The companion demo's extra report sections (Markdown appended to ``report.md``, atomically).

``append_figures_section``: the headline figures of one load point (speedups, hit rate vs the live
or workload ideal, returning turns vs their bound). ``append_light_section``: the lighter load
point's table, linking its own report in ``users<N>/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.demo.common import fmt_pct, fmt_s, fmt_x, ratio


def _append(report: Path, lines: list[str]) -> None:
    tmp = report.with_name(f".{report.name}.tmp")
    tmp.write_text(report.read_text() + "\n".join(lines))
    tmp.replace(report)


def append_figures_section(report: Path, f: dict[str, Any]) -> None:
    """The headline figures under the report's tables: speedups, hit rate vs the (live) ideal,
    returning turns vs their bound (``kvtier.demo.live.returning_turns``)."""
    rt = f["compared"]["kvtier-ram-ssd"].get("returning_turns") or {}
    lines = ["", f"## Headline figures ({f['history']} history, {f['users']} users)", "",
             f"- mean TTFT speedup vs vanilla: RAM+SSD {fmt_x(f['speedup_mean_ttft'])}, RAM-only "
             f"{fmt_x(f['ram_only_speedup'])}",
             f"- token hit rate RAM+SSD {fmt_pct(f['token_hit_rate'])} = {fmt_pct(f.get('hit_rate_vs_ideal'))} of the "
             f"ideal {fmt_pct(f['ideal_hit_rate'])} (" + ("prompts sent, with reply KV; prompt KV only "
             f"{fmt_pct(f['ideal_hit_rate_prompts'])}" if f["history"] == "live" else "workload text") + ")",
             f"- returning turns (RAM+SSD, {rt.get('requests', 0)} requests): mean TTFT {fmt_s(rt.get('ttft_mean_s'))} s "
             f"vs load of the cached prefix + cold prefill of the new tokens alone {fmt_s(rt.get('bound_mean_s'))} s "
             f"= {fmt_x(rt.get('ttft_over_bound'))}", ""]
    _append(report, lines)


def append_light_section(report: Path, lf: dict[str, Any], users: int) -> None:
    """Add the lighter load point's table to the main report (its own report is in users<N>/)."""
    lines = ["", f"## The same experiment at {users} users", "",
             f"{lf['planned_requests']} requests, {lf['size']['conversations']} conversations; full report: "
             f"[users{users}/report.md](users{users}/report.md)" + ("" if lf["complete"] else " (PARTIAL)"), "",
             "| configuration | TTFT mean (s) | p90 | speedup (mean) | token hit rate | output tokens/s "
             "| computed / request |", "|---|---|---|---|---|---|---|"]
    base = (lf["compared"].get("vanilla") or {}).get("ttft_mean_s")
    for name, c in lf["compared"].items():
        lines.append(f"| {name} | {fmt_s(c.get('ttft_mean_s'))} | {fmt_s(c.get('ttft_p90_s'))} "
                     f"| {fmt_x(ratio(base, c.get('ttft_mean_s')))} | {fmt_pct(c.get('token_hit_rate'))} "
                     f"| {fmt_s(c.get('output_tokens_per_s'))} | {_n(c.get('computed_tokens_per_request'))} |")
    lines.append(f"\nideal hit rate {fmt_pct(lf.get('ideal_hit_rate'))} ({lf['history']} history)\n")
    _append(report, lines)


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
