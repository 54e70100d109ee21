"""One simulation end to end: trace + profile + load -> result, summary, report.

``simulate`` is side-effect free; ``write_outputs`` writes ``summary.json`` (atomic),
a sample of ``requests.jsonl`` and the plots of ``kvtier bench run`` (kvtier.bench.report).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import SimProfile
from kvtier.sim.result import SimResult
from kvtier.sim.scheduler import EngineSim
from kvtier.sim.summary import summarize_sim, tier_hit_rates, to_records
from kvtier.sim.trace import SimTrace


@dataclass
class Simulation:
    trace: SimTrace
    result: SimResult
    summary: dict[str, Any]


def simulate(trace: SimTrace, profile: SimProfile, load: LoadSpec, *, windows: int = 10,
             progress: Callable[[int], None] | None = None) -> Simulation:
    res = EngineSim(trace, profile, load).run(progress)
    extra = {"simulated": True, "mode": load.mode, "concurrency": load.concurrency if load.mode == "closed" else None,
             "rate": load.rate if load.mode == "open" else None, "load": asdict(load),
             "tier_hit_rate": tier_hit_rates(trace, res), "sim_counters": res.counters,
             "unit_tokens": trace.unit_tokens, "profile": profile.description or None}
    return Simulation(trace, res, summarize_sim(trace, res, windows=windows, extra=extra))


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    tmp.replace(path)


def write_outputs(sim: Simulation, out_dir: Path, *, name: str = "simulated", plot_sample: int = 20000) -> list[Path]:
    """summary.json, requests.jsonl (a sample of at most ``plot_sample``), PNG plots."""
    from kvtier.bench.report import RunView, plot_hit_rate_over_time, plot_ttft_cdf, plot_ttft_vs_prompt
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", sim.summary)
    recs = to_records(sim.trace, sim.result, plot_sample)
    tmp = out_dir / ".requests.jsonl.tmp"
    tmp.write_text("".join(r.to_json() + "\n" for r in recs))
    tmp.replace(out_dir / "requests.jsonl")
    view = [RunView(name=name, summary=sim.summary, records=recs)]
    paths = [out_dir / "summary.json", out_dir / "requests.jsonl"]
    for fn, fname in ((plot_ttft_cdf, "ttft_cdf.png"), (plot_ttft_vs_prompt, "ttft_vs_prompt.png"),
                      (plot_hit_rate_over_time, "hit_rate_over_time.png")):
        p = fn(view, out_dir / fname)
        if p is not None:
            paths.append(p)
    p = plot_tier_hit_rate(sim.summary, out_dir / "tier_hit_rate.png")
    if p is not None:
        paths.append(p)
    return paths


def plot_tier_hit_rate(summary: dict[str, Any], path: Path) -> Path | None:
    """Stacked share of prompt tokens served by each tier, per time window."""
    from kvtier.bench.report import _finish, _plt
    wins = [w for w in summary.get("hit_rate_over_time", []) if w.get("tier_hit_rate")]
    if not wins:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [(w["t0_s"] + w["t1_s"]) / 2 for w in wins]
    ys = {k: [w["tier_hit_rate"][k] or 0.0 for w in wins] for k in ("gpu", "ram", "ssd", "shared")}
    ax.stackplot(x, *ys.values(), labels=["vLLM prefix cache", "kvtier RAM", "kvtier SSD", "shared tier"], alpha=0.8)
    return _finish(plt, fig, ax, path, xlabel="send time (s)", ylabel="share of prompt tokens",
                   title="token hit rate by tier over time")
