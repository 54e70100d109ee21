"""Render a comparison: Markdown report plus PNG plots (matplotlib, Agg backend).

Plots (one file each, skipped when there is nothing to draw):
- ``ttft_cdf.png``          TTFT CDF per configuration
- ``ttft_vs_prompt.png``    TTFT against prompt length (tokens) per configuration
- ``hit_rate_over_time.png`` token hit rate per time window (cache warm-up)
- ``slo_curve.png``         SLO statistic against load, with the SLO line
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvtier.client.stream import RequestRecord
from kvtier.client.slo import SloResult


@dataclass
class RunView:
    """What the report needs about one configuration."""

    name: str
    summary: dict[str, Any] | None
    records: Sequence[RequestRecord] = field(default_factory=list)
    slo: SloResult | None = None
    error: str | None = None
    description: str = ""


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finish(plt, fig, ax, path: Path, *, xlabel: str, ylabel: str, title: str, minor_grid: bool = False) -> Path:
    """Label, grid, legend, save as PNG and close: the common end of every plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both" if minor_grid else "major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(runs: Sequence[RunView], path: Path) -> Path | None:
    import numpy as np
    data = [(r.name, sorted(x.ttft_s for x in r.records if x.ok)) for r in runs]
    data = [(n, v) for n, v in data if v]
    if not data:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in data:
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
    ax.set_xscale("log")
    return _finish(plt, fig, ax, path, xlabel="TTFT (s, log scale)", ylabel="fraction of requests",
                   title="TTFT CDF", minor_grid=True)


def plot_ttft_vs_prompt(runs: Sequence[RunView], path: Path) -> Path | None:
    data = [(r.name, [(x.prompt_tokens, x.ttft_s) for x in r.records if x.ok and x.prompt_tokens]) for r in runs]
    data = [(n, v) for n, v in data if v]
    if not data:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in data:
        ax.scatter([p for p, _ in v], [t for _, t in v], s=10, alpha=0.6, label=name)
    ax.set_yscale("log")
    return _finish(plt, fig, ax, path, xlabel="prompt tokens", ylabel="TTFT (s, log scale)",
                   title="TTFT vs prompt length")


def plot_hit_rate_over_time(runs: Sequence[RunView], path: Path) -> Path | None:
    series = []
    for r in runs:
        windows = (r.summary or {}).get("hit_rate_over_time") or []
        pts = [((w["t0_s"] + w["t1_s"]) / 2, w["token_hit_rate"]) for w in windows if w["token_hit_rate"] is not None]
        if pts:
            series.append((r.name, pts))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series:
        ax.plot([t for t, _ in pts], [h for _, h in pts], marker="o", label=name)
    ax.set_ylim(0, 1.02)
    return _finish(plt, fig, ax, path, xlabel="time since start of run (s)",
                   ylabel="token hit rate (cached / prompt tokens)", title="Token hit rate over time (warm-up)")


def plot_slo_curve(runs: Sequence[RunView], path: Path) -> Path | None:
    curves = [(r.name, r.slo) for r in runs if r.slo is not None and r.slo.points]
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, slo in curves:
        pts = [(p.load, p.value) for p in slo.points if p.value is not None]
        line, = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        failed = [(p.load, p.value) for p in slo.points if p.value is not None and p.failed_requests]
        if failed:
            ax.scatter([x for x, _ in failed], [y for _, y in failed], marker="x", s=60, color=line.get_color())
    first = curves[0][1]
    ax.axhline(first.slo_s, color="red", linestyle="--", label=f"SLO {first.slo_s:g} s")
    ax.set_xscale("log", base=2)
    from matplotlib.ticker import ScalarFormatter
    ax.xaxis.set_major_formatter(ScalarFormatter())
    return _finish(plt, fig, ax, path,
                   xlabel="concurrent users" if first.mode == "closed" else "conversations per second",
                   ylabel=f"{first.statistic} (s)", title="SLO search", minor_grid=True)


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def render_report(runs: Sequence[RunView], out_dir: str | Path, *, title: str = "kvtier comparison",
                  speedups: dict[str, dict[str, float | None]] | None = None,
                  notes: Sequence[str] = ()) -> Path:
    """Write ``report.md`` and the plots into ``out_dir``; returns the report path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = [p for p in (plot_ttft_cdf(runs, out / "ttft_cdf.png"),
                         plot_ttft_vs_prompt(runs, out / "ttft_vs_prompt.png"),
                         plot_hit_rate_over_time(runs, out / "hit_rate_over_time.png"),
                         plot_slo_curve(runs, out / "slo_curve.png")) if p is not None]
    speedups = speedups or {}
    lines = [f"# {title}", ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    lines += ["| configuration | ok | failed | TTFT mean (s) | p50 | p90 | p99 | speedup mean | speedup p90 "
              "| token hit rate | hit rate, last half | server hit rate |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.summary or {}
        sp = speedups.get(r.name, {})
        if r.error:
            lines.append(f"| {r.name} | – | – | failed: {r.error.splitlines()[0][:80]} | | | | | | | | |")
            continue
        lines.append(" | ".join([
            f"| {r.name}", _f(s.get("requests_ok")), _f(s.get("requests_failed")), _f(s.get("ttft_mean_s")),
            _f(s.get("ttft_p50_s")), _f(s.get("ttft_p90_s")), _f(s.get("ttft_p99_s")),
            _f(sp.get("ttft_mean"), 2) + ("×" if sp.get("ttft_mean") else ""),
            _f(sp.get("ttft_p90"), 2) + ("×" if sp.get("ttft_p90") else ""),
            _pct(s.get("token_hit_rate")), _pct(s.get("token_hit_rate_last_half")),
            _pct((s.get("server") or {}).get("prefix_cache_hit_rate"))]) + " |")
    lines += ["", "Speedup = baseline (first configuration) latency / this configuration's latency.", ""]
    lines += _work_table(runs)
    lines += _turn_table(runs)
    lines += _bucket_table(runs)
    slo_runs = [r for r in runs if r.slo is not None]
    if slo_runs:
        lines += ["## SLO search", "", "| configuration | statistic | SLO (s) | best load | points |", "|---|---|---|---|---|"]
        for r in slo_runs:
            best = ("–" if r.slo.best_load is None else f"{r.slo.best_load:g}") + (" (capped)" if r.slo.capped else "")
            pts = ", ".join(f"{p.load:g}:{_f(p.value)}{'' if p.passed else '✗'}" for p in r.slo.points)
            lines.append(f"| {r.name} | {r.slo.statistic} | {r.slo.slo_s:g} | {best} | {pts} |")
        lines.append("")
    descr = [r for r in runs if r.description]
    if descr:
        lines += ["## Configurations", ""] + [f"- **{r.name}**: {r.description}" for r in descr] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    report = out / "report.md"
    tmp = out / ".report.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(report)
    return report


def _turn_table(runs: Sequence[RunView]) -> list[str]:
    lines = ["## First turn vs later turns", "", "| configuration | turns | requests | TTFT mean (s) | p90 | token hit rate |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        for key, label in (("first_turn", "first"), ("later_turns", "later")):
            g = (r.summary or {}).get(key)
            if g:
                lines.append(f"| {r.name} | {label} | {g['requests']} | {_f(g['ttft_mean_s'])} | {_f(g['ttft_p90_s'])} "
                             f"| {_pct(g['token_hit_rate'])} |")
    return lines + [""]


def _work_table(runs: Sequence[RunView]) -> list[str]:
    """Throughput and the compute saved: output tokens/s, prompt tokens really prefilled per request."""
    lines = ["## Throughput and compute", "", "| configuration | history | output tokens/s | prompt tokens / request "
             "| computed (prompt − cached) / request | TTFT p10–p90 (s) |", "|---|---|---|---|---|---|"]
    for r in runs:
        s = r.summary or {}
        if not s:
            continue
        ok = s.get("requests_ok") or 0
        per = (s.get("prompt_tokens_total") or 0) / ok if ok else None
        lines.append(f"| {r.name} | {s.get('history', 'workload')} | {_f(s.get('output_tokens_per_s'), 2)} "
                     f"| {_f(per, 0)} | {_f(s.get('computed_tokens_per_request'), 0)} "
                     f"| {_f(s.get('ttft_p10_s'))}–{_f(s.get('ttft_p90_s'))} |")
    return lines + [""]


def _bucket_table(runs: Sequence[RunView]) -> list[str]:
    lines = ["## By prompt length (tokens)", "", "| configuration | bucket | requests | TTFT mean (s) | p10 | p90 "
             "| spread p90−p10 (s) | computed / request | token hit rate |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for label, g in ((r.summary or {}).get("by_prompt_length") or {}).items():
            lines.append(f"| {r.name} | {label} | {g['requests']} | {_f(g['ttft_mean_s'])} | {_f(g.get('ttft_p10_s'))} "
                         f"| {_f(g['ttft_p90_s'])} | {_f(g.get('ttft_spread_s'))} "
                         f"| {_f(g.get('computed_tokens_per_request'), 0)} | {_pct(g['token_hit_rate'])} |")
    return lines + [""]
