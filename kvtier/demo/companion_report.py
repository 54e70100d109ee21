"""The companion demo's extra report sections (Markdown appended to ``report.md``, atomically).

``append_figures_section``: the headline figures of one load point (speedups, hit rate vs the live
or workload ideal, returning turns vs their bound). ``append_light_section``: the lighter load
point's table, linking its own report in ``users<N>/``. ``plot_regime``: the workload's miss-ratio curve
with the three chosen capacities marked (``kvtier.demo.regime``); ``predicted_vs_measured``: per
configuration the curve's predicted hit rate beside the measured one (and the closed loop's predicted
TTFT and speedup beside the measured), for ``--json``; ``time_lines``: queue / prefill / decode per
configuration from the server's histograms, with the speedup on the returning turns alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.demo.common import fmt_pct, fmt_s, fmt_x, ratio

LABELS = {"vanilla": "vanilla (engine KV)", "kvtier-ram": "kvtier RAM-only (max(engine, RAM): inclusive)",
          "kvtier-ram-ssd": "kvtier RAM+SSD (SSD)"}


def plot_regime(regime: Any, path: Path) -> Path:
    """PNG: token hit rate of one LRU tier vs its capacity (tokens, log scale), the ideal, and the three
    chosen points (each at the capacity it is predicted as) with their predicted hit rates."""
    from kvtier.bench.report import _finish, _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.step(regime.capacities_tokens, regime.hit_rate, where="post", label="one LRU tier (exact stack distances)")
    if getattr(regime, "ram_hit_rate", ()):
        ax.step(regime.ram_capacities_tokens, regime.ram_hit_rate, where="post", color="tab:orange", alpha=0.6,
                label="RAM-only's curve (tail-first eviction, its own send order)")
    ax.axhline(regime.ideal_hit_rate, ls=":", color="gray", label=f"ideal {regime.ideal_hit_rate:.1%}")
    points = (regime.engine, regime.ram, regime.ssd)
    for (name, p), color in zip(zip(LABELS, points), ("tab:red", "tab:orange", "tab:green")):
        ax.plot([p.lru_tokens], [p.predicted_hit_rate], "o", color=color, ms=8,
                label=f"{LABELS[name]}: {p.lru_tokens:,} tokens, {p.predicted_hit_rate:.1%}")
    ax.set_xscale("log")
    ax.set_ylim(0, max(0.05, regime.ideal_hit_rate * 1.1))
    return _finish(plt, fig, ax, path, xlabel="cache capacity (tokens)", ylabel="token hit rate",
                   title=f"companion workload, {regime.users} users: hit rate vs capacity", minor_grid=True)


def plot_regime_safely(regime: Any, out: Path, say: Any) -> str | None:
    """``plot_regime`` into ``out/miss_ratio_curve.png``; its file name, or None (told to ``say``) when it
    cannot be drawn: a plot must not fail the demo after its runs."""
    try:
        return plot_regime(regime, out / "miss_ratio_curve.png").name
    except Exception as e:
        say(f"no miss-ratio curve plot: {str(e).splitlines()[0] if str(e) else repr(e)}")
        return None


def predicted_vs_measured(regime: Any, compared: dict[str, Any],
                          baseline: dict[str, Any] | None = None) -> dict[str, dict[str, float | None]]:
    """Per configuration: the curve's predicted token hit rate and the measured one (its summary's);
    the closed loop's predicted mean TTFT and speedup (None without a TTFT model) and, with
    ``baseline`` (vanilla's summary), the measured speedup."""
    pt, psp = dict(getattr(regime, "predicted_ttft", ()) or ()), getattr(regime, "predicted_speedup", {}) or {}
    base = (baseline or {}).get("ttft_mean_s")
    out = {}
    for name in regime.predicted:
        c = compared.get(name) or {}
        out[name] = {"predicted_hit_rate": regime.predicted.get(name), "measured_hit_rate": c.get("token_hit_rate")}
        if pt:
            out[name].update(predicted_ttft_mean_s=pt.get(name), predicted_speedup=psp.get(name),
                             measured_ttft_mean_s=c.get("ttft_mean_s"),
                             measured_speedup=ratio(base, c.get("ttft_mean_s")) if baseline is not None else None)
    return out


def time_lines(f: dict[str, Any]) -> list[str]:
    """Markdown: where each configuration's requests spent their time (the server's histograms), the
    speedup on all turns and on the returning turns alone, and what bounds RAM+SSD's gain."""
    lines = ["", "## Where the time went (the server's own histograms, mean seconds per request)", "",
             "| configuration | queue | prefill | decode | TTFT (server) | queue / TTFT | speedup all turns "
             "| speedup returning turns | predicted speedup |", "|---|---|---|---|---|---|---|---|---|"]
    pvm = f.get("predicted_vs_measured") or {}
    for name, c in f["compared"].items():
        ph, sp = c.get("phases") or {}, c.get("speedup") or {}
        lines.append(f"| {name} | {fmt_s(ph.get('queue_mean_s'))} | {fmt_s(ph.get('prefill_mean_s'))} "
                     f"| {fmt_s(ph.get('decode_mean_s'))} | {fmt_s(ph.get('ttft_mean_s'))} "
                     f"| {fmt_pct(ph.get('queue_share_of_ttft'))} | {fmt_x(sp.get('all_turns'))} "
                     f"| {fmt_x(sp.get('returning_turns'))} | {fmt_x((pvm.get(name) or {}).get('predicted_speedup'))} |")
    van = (f["compared"].get("vanilla") or {}).get("phases") or {}
    ssd = (f["compared"].get("kvtier-ram-ssd") or {}).get("phases") or {}
    q, t, sq = van.get("queue_mean_s"), van.get("ttft_mean_s"), ssd.get("queue_mean_s")
    if q is not None and t and sq is not None:
        lines += ["", f"A vanilla request waited {fmt_s(q)} s of its {fmt_s(t)} s TTFT in the engine's queue "
                      f"({fmt_pct(q / t)}); with RAM+SSD it still waited {fmt_s(sq)} s. The engine's KV space holds "
                      "only a few requests, so a request waits for those ahead of it to prefill *and decode* "
                      f"(decode {fmt_s(ssd.get('decode_mean_s'))} s each with RAM+SSD, which the cache cannot "
                      "shorten): the all-turns ratio is bounded by that queue, the returning-turns ratio shows "
                      "the mechanism where it acts."]
    return lines + [""]


def regime_lines(regime: Any, plot: str | None) -> list[str]:
    """Markdown: where the capacities sit on the curve (predicted hit rates) and the plot."""
    lines = ["", f"## Capacities from the miss-ratio curve ({regime.users} users)", "",
             f"- ideal hit rate {fmt_pct(regime.ideal_hit_rate)}; median reuse distance of a returning turn "
             f"{regime.returning_distance_median_tokens or 0:,.0f} tokens",
             f"- vanilla: engine KV {regime.engine.tokens:,} tokens, predicted hit {fmt_pct(regime.engine.predicted_hit_rate)}",
             f"- RAM-only: RAM {regime.ram.tokens:,} tokens (reach with the engine, inclusive: {regime.ram.lru_tokens:,}), predicted "
             f"{fmt_pct(regime.ram.predicted_hit_rate)} = {fmt_pct(regime.ram.share_of_ideal)} of the ideal"
             + _ram_curve_words(regime),
             f"- RAM+SSD: SSD {regime.ssd.tokens:,} tokens, predicted {fmt_pct(regime.ssd.predicted_hit_rate)}",
             "- the RAM tier is inclusive (every computed chunk is written through), so engine + RAM reach "
             "max(engine, RAM) tokens of distinct history, not their sum"]
    sp = getattr(regime, "predicted_speedup", {}) or {}
    if sp:
        lines.append(f"- the closed-loop model's mean-TTFT speedup (engine KV space {regime.engine.tokens:,} tokens, "
                     f"requests queue beyond it): RAM-only {fmt_x(sp.get('kvtier-ram'))}, RAM+SSD "
                     f"{fmt_x(sp.get('kvtier-ram-ssd'))}")
    lines += [f"- not the published regime: {p}" for p in regime.problems]
    if plot:
        lines += ["", f"![miss-ratio curve]({plot})"]
    return lines + [""]


def _ram_curve_words(regime: Any) -> str:
    """How RAM-only's prediction was read: its own curve (tail-first eviction, its own send order)."""
    share = getattr(regime, "ram_order_share", None)
    if not getattr(regime, "ram_hit_rate", ()) or share is None:
        return ""
    return (f", on its own curve: chains evicted tail first (kvtier's tiers and vLLM's block pool), turns in "
            f"the order a run at {fmt_pct(share)} of the ideal sends them")


def append_lines(report: Path, lines: list[str]) -> None:
    """Append ``lines`` to the report, replacing it atomically (a reader sees the old or the new one)."""
    tmp = report.with_name(f".{report.name}.tmp")
    tmp.write_text(report.read_text() + "\n".join(lines))
    tmp.replace(report)


def append_figures_section(report: Path, f: dict[str, Any], regime: Any = None, plot: str | None = None) -> None:
    """The headline figures under the report's tables: speedups, hit rate vs the (live) ideal,
    returning turns vs their bound (``kvtier.demo.live.returning_turns``), predicted vs measured hit
    rates and, with ``regime``, where the capacities sit on the curve (``plot``: the PNG's relative path)."""
    rt = f["compared"]["kvtier-ram-ssd"].get("returning_turns") or {}
    lines = ["", f"## Headline figures ({f['history']} history, {f['users']} users)", ""]
    if f.get("ram_only_band_missed"):
        lines.append(f"- **not the published regime on this run: {f['ram_only_band_missed']}**")
    lines += [f"- mean TTFT speedup vs vanilla: RAM+SSD {fmt_x(f['speedup_mean_ttft'])}, RAM-only "
              f"{fmt_x(f['ram_only_speedup'])}",
              f"- token hit rate RAM+SSD {fmt_pct(f['token_hit_rate'])} = {fmt_pct(f.get('hit_rate_vs_ideal'))} of the "
              f"ideal {fmt_pct(f['ideal_hit_rate'])} (" + ("prompts sent, with reply KV; prompt KV only "
              f"{fmt_pct(f['ideal_hit_rate_prompts'])}" if f["history"] == "live" else "workload text") + ")",
              f"- returning turns (RAM+SSD, {rt.get('requests', 0)} requests): mean TTFT {fmt_s(rt.get('ttft_mean_s'))} s "
              f"vs load of the cached prefix + cold prefill of the new tokens alone {fmt_s(rt.get('bound_mean_s'))} s "
              f"= {fmt_x(rt.get('ttft_over_bound'))}", ""]
    for name, pm in (f.get("predicted_vs_measured") or {}).items():
        lines.insert(-1, f"- {name}: token hit rate predicted by the curve {fmt_pct(pm['predicted_hit_rate'])}, "
                         f"measured {fmt_pct(pm['measured_hit_rate'])}")
    lines += time_lines(f)
    if regime is not None:
        lines += regime_lines(regime, plot)
    append_lines(report, lines)


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
    append_lines(report, lines)


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
