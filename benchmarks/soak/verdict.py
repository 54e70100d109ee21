"""The soak's verdict (benchmarks/soak/soak.py), from the replay summary and the samples. ``summarize``
is side-effect free; ``python benchmarks/soak/verdict.py RUN [--vanilla-ref DIR]`` re-judges a run folder.

The rules (docs/results.md#soak and benchmarks/soak/README.md give the reasons):

- **Requests**: at least one served, 0 failed, 0 cancelled (the client's timeouts are long).
- **SSD**: the SSD tier's bytes on disk <= its budget at every sample.
- **RSS within budget**, every process, every sample at minute m:
  ``budget(m) = reference(m) + kvtier(m) + margin`` where
  ``reference(m)`` is the same process (by role: API server, engine core, worker, other) of a
  *vanilla* run of the same workload (``reference``: vLLM without kvtier): its largest RSS up to
  minute m (past the end of that run: its largest RSS over the run). Without a reference it is the
  process's own first sample, which assumes vLLM itself does not grow (it does, see docs/results.md).
  ``kvtier(m)``, the vLLM worker only (kvtier's RAM tier and buffers live there): the RAM tier's
  budget + the connector's own buffers (``fixed_staging_bytes``: the save lane's host buffers and the load
  buffers) + the disk writer's staging buffers mapped at that sample (one chunk each; their count
  must also stay <= ``staging_max_buffers``, the write queue's depth). Other processes: 0.
  ``margin``: ``margin_bytes`` (default 128 MiB: kvtier's code and Python objects, allocator slack).
- **No growth in the last third**: every process's RSS slope (least squares over the samples in the
  last third of the run) <= ``slope_bound_mib_per_min`` (default 2 MiB/min: 20 MiB over the last
  10 minutes of a 30-minute soak, ~1% of the worker); at least 3 samples there, or the run is too
  short to judge. Open files and threads at every sample of the second half <= their largest value
  in the first half after warm-up (from sample ``warmup``: thread pools start on the first requests)
  x 1.1 + 2 (the API server's open files are its client sockets: they go up and down with the
  requests in flight, so one warm-up sample is no baseline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class SoakBudgets:
    """What the soak's server may use. ``kvtier``: False for a vanilla run (no kvtier memory)."""

    ssd_bytes: int
    ram_bytes: int
    fixed_staging_bytes: int = 0
    chunk_bytes: int = 0
    staging_max_buffers: int = 0
    margin_bytes: int = 128 * MIB
    slope_bound_mib_per_min: float = 2.0
    kvtier: bool = True


def role(name: str) -> str:
    """A process's role in a vLLM server (to pair it with the same process of another run)."""
    if "api_server" in name:
        return "api_server"
    if "EngineCore" in name:
        return "engine_core"
    if "Worker" in name:
        return "worker"
    return "other"


def _series(samples: list[dict]) -> dict[str, list[tuple[float, dict]]]:
    """role -> [(minutes since the first sample, process sample)]; a second process of one role gets ``role#2``."""
    t0 = samples[0]["t"]
    pid_role: dict[str, str] = {}
    out: dict[str, list[tuple[float, dict]]] = {}
    for s in samples:
        for pid, p in s["procs"].items():
            if pid not in pid_role:
                r, n = role(p["name"]), 1
                while (r if n == 1 else f"{r}#{n}") in pid_role.values():
                    n += 1
                pid_role[pid] = r if n == 1 else f"{r}#{n}"
            out.setdefault(pid_role[pid], []).append(((s["t"] - t0) / 60, p))
    return out


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points; None with fewer than 2 distinct x."""
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def _last_third(series: list[tuple[float, dict]], end: float) -> list[tuple[float, float]]:
    return [(m, p["rss"] / MIB) for m, p in series if m >= end * 2 / 3]


def _reference_at(ref: list[tuple[float, dict]], minute: float) -> int:
    """The reference process's largest RSS up to ``minute`` (samples ~1 min apart: a 0.5 min tolerance)."""
    seen = [p["rss"] for m, p in ref if m <= minute + 0.5]
    return max(seen) if seen else ref[0][1]["rss"]


def _grew(series: list[int], base: int) -> bool:
    return any(v > base * 1.1 + 2 for v in series)


def _judge_process(name: str, series: list[tuple[float, dict]], ref: list[tuple[float, dict]] | None,
                   b: SoakBudgets, end: float, base_i: int, half: float, is_worker: bool) -> tuple[dict, list[str]]:
    why: list[str] = []
    worst = None          # (rss - budget, minute, rss, budget)
    staging_max = 0
    for m, p in series:
        reference = _reference_at(ref, m) if ref else series[0][1]["rss"]
        kv = 0
        if is_worker and b.kvtier:
            n = p.get("staging_maps", 0)
            staging_max = max(staging_max, n)
            kv = b.ram_bytes + b.fixed_staging_bytes + n * b.chunk_bytes
        budget = reference + kv + b.margin_bytes
        if worst is None or p["rss"] - budget > worst[0]:
            worst = (p["rss"] - budget, m, p["rss"], budget)
    assert worst is not None
    tail = _last_third(series, end)
    s = slope(tail) if len(tail) >= 3 else None
    early = [p for i, (m, p) in enumerate(series) if i >= base_i and m < half] or [series[-1][1]]
    base = {k: max(p[k] for p in early) for k in ("fds", "threads")}
    late = [p for m, p in series if m >= half] or [series[-1][1]]
    out = {"name": name, "rss_first": series[0][1]["rss"], "rss_max": max(p["rss"] for _, p in series),
           "rss_last": series[-1][1]["rss"], "rss_worst_minute": round(worst[1], 2),
           "rss_at_worst": worst[2], "rss_budget_at_worst": worst[3], "rss_ok": worst[0] <= 0,
           "reference": "vanilla run" if ref else "own first sample",
           "rss_slope_last_third_mib_per_min": s, "slope_ok": s is not None and s <= b.slope_bound_mib_per_min,
           "fds_baseline": base["fds"], "fds_max_second_half": max(p["fds"] for p in late),
           "threads_baseline": base["threads"], "threads_max_second_half": max(p["threads"] for p in late)}
    if ref:
        out["reference_rss_max"] = max(p["rss"] for _, p in ref)
        rs = _last_third(ref, ref[-1][0])
        out["reference_slope_last_third_mib_per_min"] = slope(rs) if len(rs) >= 3 else None
    if is_worker and b.kvtier:
        out["staging_maps_max"] = staging_max
    out["no_growth"] = not (_grew([p["fds"] for p in late], base["fds"])
                            or _grew([p["threads"] for p in late], base["threads"]))
    if not out["rss_ok"]:
        why.append(f"RSS of the {name} {worst[2] / MIB:.0f} MiB over its budget {worst[3] / MIB:.0f} MiB "
                   f"at minute {worst[1]:.1f}")
    if s is None:
        why.append(f"too few samples in the last third to judge the {name}'s growth ({len(tail)} < 3)")
    elif not out["slope_ok"]:
        why.append(f"RSS of the {name} grows {s:.1f} MiB/min over the last third "
                   f"(bound {b.slope_bound_mib_per_min} MiB/min)")
    if is_worker and b.kvtier and staging_max > b.staging_max_buffers:
        why.append(f"{staging_max} writer staging buffers mapped, more than the queue depth {b.staging_max_buffers}")
    if not out["no_growth"]:
        why.append(f"open files / threads of the {name} grew")
    return out, why


def summarize(replay: dict, samples: list[dict], budgets: SoakBudgets, *,
              reference: list[dict] | None = None, warmup: int = 2) -> dict:
    """The verdict (``passed``, ``why_not``) and per-process figures; ``reference``: a vanilla run's samples."""
    series = _series(samples)
    refs = _series(reference) if reference else {}
    end = (samples[-1]["t"] - samples[0]["t"]) / 60
    procs, why = {}, []
    for r, ser in series.items():
        ref = refs.get(r, []) if reference else None
        procs[r], w = _judge_process(r, ser, ref, budgets, end, warmup, end / 2, r == "worker")
        why += w
    disk_max = max(s["disk_bytes"] for s in samples)
    if disk_max > budgets.ssd_bytes:
        why.append(f"SSD bytes {disk_max} over the budget {budgets.ssd_bytes}")
    ok, failed = replay.get("requests_ok", 0), replay.get("requests_failed", 0)
    cancelled = replay.get("requests_cancelled", 0)
    if failed or cancelled or not ok:
        why.append(f"requests: {ok} ok, {failed} failed, {cancelled} cancelled")
    loads = [s["loadavg"][0] for s in samples if "loadavg" in s]
    return {"requests_ok": ok, "requests_failed": failed, "requests_cancelled": cancelled,
            "errors_by_kind": replay.get("errors_by_kind"), "stopped_reason": replay.get("stopped_reason"),
            "ttft_mean_s": replay.get("ttft_mean_s"), "token_hit_rate": replay.get("token_hit_rate"),
            "duration_s": samples[-1]["t"] - samples[0]["t"], "samples": len(samples), "processes": procs,
            "disk_max_bytes": disk_max, "disk_budget_bytes": budgets.ssd_bytes, "ram_budget_bytes": budgets.ram_bytes,
            "verdict_budgets": dataclasses.asdict(budgets), "vanilla_reference": reference is not None,
            "loadavg_1min": loads and {"min": min(loads), "mean": sum(loads) / len(loads), "max": max(loads)},
            "passed": not why, "why_not": why}


def read_samples(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines() if x.strip()]


def budgets_of(meta: dict, margin_mib: float = 128, slope_bound: float = 2.0) -> SoakBudgets:
    """A run's budgets from its summary.json (the earliest recorded runs lack the chunk and queue fields:
    they are derived from the demo's chunk size and the disk tier's default queue depth)."""
    chunk = meta.get("chunk_payload_bytes") or 128 * meta["budgets"]["kv_bytes_per_token"]
    return SoakBudgets(ssd_bytes=meta["budgets"]["ssd_budget_bytes"], ram_bytes=meta["budgets"]["ram_budget_bytes"],
                       fixed_staging_bytes=meta.get("fixed_staging_bytes", 4 * chunk), chunk_bytes=chunk,
                       staging_max_buffers=meta.get("staging_max_buffers", 256), margin_bytes=int(margin_mib * MIB),
                       slope_bound_mib_per_min=slope_bound, kvtier=not meta.get("vanilla", False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="re-judge a soak run folder (samples.jsonl, replay.json, summary.json)")
    ap.add_argument("run", type=Path)
    ap.add_argument("--vanilla-ref", type=Path, default=None, help="a vanilla soak's folder (same workload)")
    ap.add_argument("--margin-mib", type=float, default=128.0)
    ap.add_argument("--slope-bound", type=float, default=2.0, help="MiB/min over the last third")
    ap.add_argument("--write", type=Path, default=None, help="write the verdict (JSON) here")
    args = ap.parse_args(argv)
    try:
        meta = json.loads((args.run / "summary.json").read_text())
        rp = args.run / "replay.json"           # the 8-minute diagnosis runs kept only summary.json
        replay = json.loads(rp.read_text()) if rp.exists() else meta
        samples = read_samples(args.run)
        reference = read_samples(args.vanilla_ref) if args.vanilla_ref else None
    except (OSError, ValueError) as e:
        print(f"error: cannot read the run: {e}", file=sys.stderr)
        return 2
    if not samples:
        print(f"error: {args.run}/samples.jsonl has no samples", file=sys.stderr)
        return 2
    v = summarize(replay, samples, budgets_of(meta, args.margin_mib, args.slope_bound), reference=reference)
    v["vanilla_reference_folder"] = args.vanilla_ref and str(args.vanilla_ref)
    text = json.dumps(v, indent=1)
    if args.write:
        args.write.write_text(text + "\n")
    print(json.dumps({k: v[k] for k in ("requests_ok", "requests_failed", "passed", "why_not")}, indent=1))
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
