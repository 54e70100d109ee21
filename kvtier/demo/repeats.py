"""``kvtier demo --repeats N``: the three configurations N times, in alternating order, on the same
workload, so that a configuration's effect can be told from the machine's drift.

A 2-vCPU cloud machine's speed drifts by 20-30% over minutes (one Intel AMX machine measured its own
1K-token prefill at 0.64-1.32 s the same day), as large as what a RAM tier does to TTFT where decode
sets the queue. One replay per configuration in a fixed order puts that drift on whichever ran at the
slow moment. Repeat k (1-based) runs the configurations in the demo's order when k is odd and in
reverse when it is even (vanilla, RAM, RAM+SSD; RAM+SSD, RAM, vanilla; ...): a drift linear in time
falls alike on every configuration over two repeats. Each on a fresh server, as the first.

A repeat's speedup of a configuration is vanilla's mean TTFT *in that repeat* over the configuration's;
the figures are the median over the repeats, with the min and max (``summarize``). Repeat 1 is the
demo's full report (tables, plots, time breakdown, in the results folder); repeat k > 1 is in
``repeat-<k>/``. A repeat where a configuration did not serve every planned request is marked
incomplete (its means are over fewer requests); the summary says whether all were complete.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.demo.common import fmt_pct, fmt_s, fmt_x, ratio
from kvtier.demo.companion_report import append_lines

BASELINE = "vanilla"
#: the repeats' table columns (console and report)
HEADER = ["configuration", "TTFT mean s", "speedup", "returning turns", "token hit rate"]


def repeat_order(names: Sequence[str], repeat: int) -> list[str]:
    """The configurations' order in repeat ``repeat`` (1-based): as given when odd, reversed when even."""
    if repeat < 1:
        raise ValueError(f"repeats are numbered from 1, got {repeat}")
    return list(names) if repeat % 2 else list(reversed(names))


def repeat_entry(repeat: int, runs: Sequence[Any], planned: int) -> dict[str, Any]:
    """One repeat's figures from its ``ConfigRun``s (``kvtier.bench.compare``): per configuration the
    mean TTFT over all turns and over the returning turns, the token hit rate, the requests served and
    the server's mean queue/prefill/decode seconds. Pure."""
    from kvtier.client.summary import phase_means

    configs = {}
    for run in runs:
        s = run.summary or {}
        configs[run.name] = {"ttft_mean_s": s.get("ttft_mean_s"),
                             "returning_ttft_mean_s": (s.get("later_turns") or {}).get("ttft_mean_s"),
                             "token_hit_rate": s.get("token_hit_rate"), "requests_ok": s.get("requests_ok") or 0,
                             "error": run.error, "phases": phase_means(s)}
    complete = all(c["requests_ok"] == planned and c["error"] is None for c in configs.values())
    return {"repeat": repeat, "order": [r.name for r in runs], "complete": complete, "configs": configs}


def _spread(xs: list[float]) -> dict[str, Any] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "per_repeat": xs}


def summarize(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration over the repeats: mean TTFT, its speedup against vanilla's mean TTFT of the same
    repeat (all turns and returning turns), token hit rate: median, min, max and the per-repeat values.
    A repeat missing a figure is left out of that figure. Pure."""
    names = list(dict.fromkeys(n for e in entries for n in e["configs"]))
    out: dict[str, Any] = {}
    for name in names:
        cs = [(e["configs"].get(BASELINE) or {}, e["configs"].get(name) or {}) for e in entries]
        speed = [ratio(b.get("ttft_mean_s"), c.get("ttft_mean_s")) for b, c in cs]
        ret = [ratio(b.get("returning_ttft_mean_s"), c.get("returning_ttft_mean_s")) for b, c in cs]
        out[name] = {"ttft_mean_s": _spread([c["ttft_mean_s"] for _, c in cs if c.get("ttft_mean_s") is not None]),
                     "speedup": _spread([x for x in speed if x is not None]),
                     "speedup_returning_turns": _spread([x for x in ret if x is not None]),
                     "token_hit_rate": _spread([c["token_hit_rate"] for _, c in cs
                                                if c.get("token_hit_rate") is not None])}
    return {"repeats": len(entries), "complete": all(e["complete"] for e in entries),
            "orders": [e["order"] for e in entries], "configs": out, "runs": list(entries)}


def run_repeats(n: int, specs: Sequence[Any], first_runs: Sequence[Any], planned: int, workload: Path, out: Path,
                replay_options: Any, title: str, on_event: Callable[[str], None],
                start_server: Callable | None = None) -> dict[str, Any]:
    """Repeats 2..``n`` of the comparison (repeat 1's runs are ``first_runs``), each in ``repeat_order``,
    in ``out/repeat-<k>/``; returns ``summarize`` of all ``n``."""
    from kvtier.bench.compare import run_compare

    entries = [repeat_entry(1, first_runs, planned)]
    by_name = {s.name: s for s in specs}
    kw = {"start_server": start_server} if start_server is not None else {}
    for k in range(2, n + 1):
        order = [by_name[name] for name in repeat_order([s.name for s in specs], k)]
        on_event(f"repeat {k} of {n}: {', '.join(s.name for s in order)}")
        result = run_compare(workload, order, out / f"repeat-{k}", replay_options,
                             title=f"{title}, repeat {k} of {n}", on_event=on_event, **kw)
        entries.append(repeat_entry(k, result.runs, planned))
    return summarize(entries)


def _cell(d: dict[str, Any] | None, fmt: Callable[[float], str]) -> str:
    if not d:
        return "-"
    return f"{fmt(d['median'])} ({fmt(d['min'])}-{fmt(d['max'])})"


def repeats_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Table rows: configuration, mean TTFT, speedup, returning turns' speedup, token hit rate
    (median (min-max) over the repeats)."""
    return [[name, _cell(c["ttft_mean_s"], fmt_s), _cell(c["speedup"], fmt_x),
             _cell(c["speedup_returning_turns"], fmt_x), _cell(c["token_hit_rate"], fmt_pct)]
            for name, c in summary["configs"].items()]


def repeats_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"{summary['repeats']} repeats, alternating order: median (min-max) over the repeats"
                    + ("" if summary["complete"] else " (some repeats PARTIAL)"))
    for h in HEADER:
        t.add_column(h)
    for row in repeats_rows(summary):
        t.add_row(*row)
    return t


def append_repeats_section(report: Path, summary: dict[str, Any]) -> None:
    """The repeats' table in the main report, with each repeat's order and its own report."""
    lines = ["", f"## {summary['repeats']} repeats in alternating order", "",
             "Each speedup is vanilla's mean TTFT in the same repeat over the configuration's; median (min-max) "
             "over the repeats" + ("." if summary["complete"] else "; some repeats did not serve every request."),
             "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in repeats_rows(summary)]
    lines.append("")
    for e, order in zip(summary["runs"], summary["orders"]):
        where = "this report" if e["repeat"] == 1 else f"[repeat-{e['repeat']}/report.md](repeat-{e['repeat']}/report.md)"
        lines.append(f"- repeat {e['repeat']}: {', '.join(order)} ({where})")
    append_lines(report, lines + [""])
