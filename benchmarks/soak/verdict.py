"""The soak's verdict (benchmarks/soak/soak.py), from the replay summary and the samples. Side-effect free.

Budgets: the SSD tier's bytes on disk <= its budget at every sample; every process's resident
memory <= its budget = its RSS at the first sample (server started, idle) + kvtier's RAM budget
+ max(256 MiB, 25% of that first RSS) (staging buffers, allocator slack). No growth: open files
and threads at the last sample and at every sample of the second half <= the warmed-up baseline
(the sample at ``warmup`` index: thread pools start on the first requests) x 1.1 + 2. Every
request served: 0 failed, 0 cancelled (the client's timeouts are long), at least one ok. The RSS
slope over the second half is reported, not judged (the RAM tier fills towards its budget).
"""

from __future__ import annotations

MIB = 2**20


def _grew(series: list[int], base: int) -> bool:
    return any(v > base * 1.1 + 2 for v in series)


def summarize(replay: dict, samples: list[dict], *, ssd_budget: int, ram_budget: int, warmup: int = 2) -> dict:
    first = samples[0]
    base_i = min(warmup, len(samples) - 1)
    half = len(samples) // 2
    procs, why = {}, []
    for pid in first["procs"]:
        series = [s["procs"][pid] for s in samples if pid in s["procs"]]
        idx = [i for i, s in enumerate(samples) if pid in s["procs"]]
        rss0 = series[0]["rss"]
        budget = rss0 + ram_budget + max(256 * MIB, rss0 // 4)
        base = next((x for i, x in zip(idx, series) if i >= base_i), series[-1])
        late = [x for i, x in zip(idx, series) if i >= half] or series[-1:]
        rss_max = max(x["rss"] for x in series)
        tail = [(samples[i]["t"], x["rss"]) for i, x in zip(idx, series) if i >= half]
        slope = ((tail[-1][1] - tail[0][1]) / MIB / ((tail[-1][0] - tail[0][0]) / 60)
                 if len(tail) >= 2 and tail[-1][0] > tail[0][0] else 0.0)
        p = {"name": series[0]["name"], "rss_first": rss0, "rss_max": rss_max, "rss_last": series[-1]["rss"],
             "rss_budget": budget, "rss_ok": rss_max <= budget, "rss_slope_second_half_mib_per_min": slope,
             "fds_baseline": base["fds"], "fds_max_second_half": max(x["fds"] for x in late),
             "fds_last": series[-1]["fds"], "threads_baseline": base["threads"],
             "threads_max_second_half": max(x["threads"] for x in late), "threads_last": series[-1]["threads"]}
        p["no_growth"] = not (_grew([x["fds"] for x in late], base["fds"])
                              or _grew([x["threads"] for x in late], base["threads"]))
        procs[pid] = p
        if not p["rss_ok"]:
            why.append(f"RSS of {pid} ({p['name']}) {rss_max / MIB:.0f} MiB over its budget {budget / MIB:.0f} MiB")
        if not p["no_growth"]:
            why.append(f"open files / threads of {pid} ({p['name']}) grew")
    disk_max = max(s["disk_bytes"] for s in samples)
    if disk_max > ssd_budget:
        why.append(f"SSD bytes {disk_max} over the budget {ssd_budget}")
    ok, failed = replay.get("requests_ok", 0), replay.get("requests_failed", 0)
    cancelled = replay.get("requests_cancelled", 0)
    if failed or cancelled or not ok:
        why.append(f"requests: {ok} ok, {failed} failed, {cancelled} cancelled")
    return {"requests_ok": ok, "requests_failed": failed, "requests_cancelled": cancelled,
            "errors_by_kind": replay.get("errors_by_kind"), "stopped_reason": replay.get("stopped_reason"),
            "ttft_mean_s": replay.get("ttft_mean_s"), "token_hit_rate": replay.get("token_hit_rate"),
            "duration_s": samples[-1]["t"] - first["t"], "samples": len(samples), "processes": procs,
            "disk_max_bytes": disk_max, "disk_budget_bytes": ssd_budget, "ram_budget_bytes": ram_budget,
            "passed": not why, "why_not": why}
