"""Pool the runs of ``run.py`` (every ``*.summary.json`` in a folder) into the cross-check's tables.

Per server x client: all requests of all repeats pooled (mean TTFT, per-turn means, e2e, decode), the
client's CPU, and the server's own TTFT from its ``/metrics`` histogram; per run: the client's mean
TTFT over the server's (does each client measure what the server saw?) and, per repeat, the two
clients' ratio on each server.

Usage:
    python benchmarks/multi_turn_crosscheck/summarize.py DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def load(folder: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.summary.json"))]
    return sorted(runs, key=lambda r: (r["tag"], r["server"], r["order"]))


def pooled(runs: list[dict]) -> dict:
    reqs = [q for r in runs for q in r["per_request"]]
    turns = sorted({q["turn"] for q in reqs})
    return {"runs": len(runs), "requests": len(reqs),
            "ttft_mean_s": statistics.mean(q["ttft_s"] for q in reqs),
            "ttft_turn_mean_s": [statistics.mean(q["ttft_s"] for q in reqs if q["turn"] == t) for t in turns],
            "e2e_mean_s": statistics.mean(q["e2e_s"] for q in reqs),
            "decode_mean_s": statistics.mean(q["e2e_s"] - q["ttft_s"] for q in reqs),
            "run_ttft_means_s": [r["ttft_mean_s"] for r in runs],
            "server_ttft_mean_s": statistics.mean(r["server_view"]["time_to_first_token_seconds_mean"] for r in runs),
            "client_cpu_s": statistics.mean(r["cpu_s"]["client"] for r in runs),
            "run_s": statistics.mean(r["run_s"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    runs = load(a.folder)
    servers = sorted({r["server"] for r in runs}, key=lambda s: (s != "vanilla", s))
    out: dict = {"pooled": {}, "ratio_pooled": {}, "ratio_per_repeat": {}, "runs": []}

    print("| server | client | runs | requests | TTFT mean (s) | turn 0 / 1 / 2 mean (s) | e2e mean (s) "
          "| decode mean (s) | server's TTFT mean (s) | client CPU (s/run) | run (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in servers:
        for c in ("vllm", "kvtier"):
            sel = [r for r in runs if r["server"] == s and r["client"] == c]
            if not sel:
                continue
            p = pooled(sel)
            out["pooled"][f"{s}/{c}"] = p
            name = "vLLM multi-turn client" if c == "vllm" else "kvtier `--history live`"
            print(f"| {s} | {name} | {p['runs']} | {p['requests']} | {_f(p['ttft_mean_s'])} | "
                  f"{' / '.join(_f(x) for x in p['ttft_turn_mean_s'])} | {_f(p['e2e_mean_s'])} | "
                  f"{_f(p['decode_mean_s'])} | {_f(p['server_ttft_mean_s'])} | {_f(p['client_cpu_s'], 1)} | "
                  f"{_f(p['run_s'], 1)} |")
    print()
    for s in servers:
        v, k = out["pooled"].get(f"{s}/vllm"), out["pooled"].get(f"{s}/kvtier")
        if v and k:
            out["ratio_pooled"][s] = k["ttft_mean_s"] / v["ttft_mean_s"]
            print(f"{s}: pooled mean TTFT kvtier/vLLM client = {out['ratio_pooled'][s]:.3f} "
                  f"({abs(1 - out['ratio_pooled'][s]) * 100:.1f}% apart)")
        for tag in sorted({r["tag"] for r in runs if r["server"] == s}):
            rv = [r for r in runs if r["server"] == s and r["tag"] == tag and r["client"] == "vllm"]
            rk = [r for r in runs if r["server"] == s and r["tag"] == tag and r["client"] == "kvtier"]
            if rv and rk:
                ratio = rk[0]["ttft_mean_s"] / rv[0]["ttft_mean_s"]
                first = "vllm" if rv[0]["order"] < rk[0]["order"] else "kvtier"
                out["ratio_per_repeat"][f"{s}/{tag}"] = {"ratio": ratio, "first": first}
                print(f"  {tag}: kvtier/vLLM = {ratio:.3f} (first run: {first} client)")
    print()
    print("| repeat | server | client | order | TTFT mean (s) | server's TTFT mean (s) | client/server "
          "| ITL mean, server (ms) | decode mean (s) | CPU s: client / server / machine / other | load before → after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        sv = r["server_view"]
        ratio = r["ttft_mean_s"] / sv["time_to_first_token_seconds_mean"]
        cpu = r["cpu_s"]
        out["runs"].append({k: v for k, v in r.items() if k != "per_request"} | {"client_over_server": ratio})
        print(f"| {r['tag']} | {r['server']} | {r['client']} | {r['order']} | {_f(r['ttft_mean_s'])} | "
              f"{_f(sv['time_to_first_token_seconds_mean'])} | {ratio:.4f} | "
              f"{_f(sv['inter_token_latency_seconds_mean'] * 1000, 1)} | {_f(r['decode_mean_s'])} | "
              f"{cpu['client']:.1f} / {cpu['server']:.1f} / {cpu['machine']:.1f} / {cpu['other']:.1f} | "
              f"{r['loadavg_before'].split()[0]} → {r['loadavg_after'].split()[0]} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
