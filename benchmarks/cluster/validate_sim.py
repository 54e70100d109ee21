"""Validate the cluster simulator against a measured ``kvtier demo cluster --json`` run.

For every measured run (configuration vanilla | local | shared x routing roundrobin | sticky |
kv-aware) the same workload is simulated with the same number of replicas, the same capacities
(vLLM's KV cache, RAM, SSD per replica; the shared tier) and the same load, and the errors are
reported: token hit rate within 5 points and TTFT mean within 15% (the targets), TTFT p90 and the
requests per replica beside them.

The simulator's profile comes from the run's own calibration (the demo's prefill profile,
``kvtier.demo.calibrate``: cold prefill ``a + b n + c n^2`` and a decode step with 1 and 4
sequences) — nothing is fitted to the cluster runs:

* ``prefill_attn_s = 2c`` (a prompt of n tokens has n(n+1)/2 attention pairs),
  ``prefill_token_s = b - c``;
* decode step with D sequences = ``t1 + (t4 - t1)(D - 1)/3``: ``decode_seq_s = (t4 - t1)/3``,
  ``step_overhead_s = t1 - decode_seq_s``;
* ``request_overhead_s = a - step_overhead_s`` (at least 0): the fixed cost beyond one step;
* KV bytes per token, block size, step budget, chunk size: from the run's JSON when it names
  them (``--kv-bytes-per-token`` etc. override), else kvtier's defaults (printed);
* tier read speeds: ``--ram-read-bw`` / ``--ssd-read-bw`` / ``--shared-read-bw`` (defaults: the
  simulator's profile defaults; the demo does not measure them).

What the simulation cannot copy: prompts are the workload's text (with the demo's ``history:
live`` the servers saw the model's own replies instead: other lengths, the same prefix structure);
sticky routing is the demo's own: HAProxy's consistent hash decides which replica a conversation
lands on, so the conversation -> replica map is asked of a real HAProxy with the demo's config
(``haproxy_assignment.py``; ``--sticky-hash sdbm`` uses the simulator's ``sdbm mod N`` instead: the
same stickiness, another assignment). The kv-aware router is the
demo's (``kvtier.client.router``: a shared block counts for every replica, so the order is the
replica's own leading blocks, then fewest in flight, then replica order).

Usage: python benchmarks/cluster/validate_sim.py MEASURED.json [--out DIR] [--tokenizer approx]
Writes validation.json and validation.md into ``--out`` (default: next to this projection's results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtier.sim.cluster import run_cluster  # noqa: E402
from kvtier.sim.load import LoadSpec  # noqa: E402
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "cluster-projection" / "2026-12-04-avx2" / "validation"
HIT_POINTS = 0.05       # target: |simulated - measured| token hit rate
TTFT_REL = 0.15         # target: |simulated - measured| / measured TTFT mean
CONFIGS = ("vanilla", "local", "shared")


class ValidationInputError(ValueError):
    """The measured file (or what it names) is unusable; one line."""


@dataclass(frozen=True)
class Knobs:
    """What the measured file may not say, with where each value came from."""
    kv_bytes_per_token: int
    block_size: int
    max_num_batched_tokens: int
    chunk_size: int
    ram_read_bw: float
    ssd_read_bw: float
    shared_read_bw: float
    sources: dict[str, str]


def find(d: dict, *names: str) -> Any:
    """The first of ``names`` in ``d`` or its ``machine`` / ``capacities`` / ``engine`` mapping (None: absent)."""
    for scope in (d, d.get("machine") or {}, d.get("capacities") or {}, d.get("engine") or {}):
        for n in names:
            if isinstance(scope, dict) and scope.get(n) is not None:
                return scope[n]
    return None


def resolve(measured: Path, name: str) -> Path:
    p = Path(name)
    for cand in (p, measured.parent / p, ROOT / p):
        if cand.is_file():
            return cand
    raise ValidationInputError(f"{measured}: names {name!r}, not found (absolute, next to it, or in the repository)")


def calibration_of(measured: Path, data: dict):
    from kvtier.demo.calibrate import Calibration, load_calibration
    inline = data.get("prefill_profile")            # the demo's copy of its calibration
    if isinstance(inline, dict):
        return Calibration.from_dict(inline.get("calibration", inline)).profile
    cal = data.get("calibration")
    if cal is None:
        raise ValidationInputError(f"{measured}: no 'calibration' nor 'prefill_profile' (the prefill profile)")
    if isinstance(cal, dict):
        return Calibration.from_dict(cal.get("calibration", cal)).profile
    return load_calibration(resolve(measured, str(cal)), None).profile


def engine_from(pp, kv_cache_tokens: int, k: Knobs) -> EngineProfile:
    """The step-cost model from the demo's prefill profile (module docstring)."""
    pts = sorted(pp.decode_points)
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
        (n0, t0), (n1, t1) = pts[0], pts[-1]
        per_seq = max(0.0, (t1 - t0) / (n1 - n0))
        overhead = max(0.0, t0 - per_seq * n0)
    elif pts:
        per_seq, overhead = 0.0, pts[0][1]
    else:
        per_seq, overhead = 0.0, pp.a
    return EngineProfile(block_size=k.block_size, max_num_batched_tokens=k.max_num_batched_tokens,
                         kv_cache_tokens=kv_cache_tokens, step_overhead_s=overhead,
                         prefill_token_s=max(0.0, pp.b - pp.c), prefill_attn_s=2 * pp.c, decode_seq_s=per_seq,
                         decode_ctx_s=0.0, request_overhead_s=max(0.0, pp.a - overhead))


def profile_for(run: dict, pp, k: Knobs) -> SimProfile:
    cap = run.get("capacities") or {}
    cfg = run["config"]
    if cfg not in CONFIGS:
        raise ValidationInputError(f"unknown config {cfg!r} (vanilla, local or shared)")
    kv_tokens = int(cap.get("kv_cache_tokens") or 0)
    if kv_tokens <= 0:
        raise ValidationInputError(f"run {cfg}/{run.get('routing')}: capacities.kv_cache_tokens missing")
    ram = int(cap.get("ram_bytes") or 0) if cfg != "vanilla" else 0
    ssd = int(cap.get("ssd_bytes") or 0) if cfg != "vanilla" else 0
    shared = int(cap.get("shared_bytes") or 0) if cfg == "shared" else 0
    return SimProfile(description=f"from the demo's calibration ({cfg})", source="benchmarks/cluster/validate_sim.py",
                      kv_bytes_per_token=k.kv_bytes_per_token, chunk_size=k.chunk_size, save=cfg != "vanilla",
                      engine=engine_from(pp, kv_tokens, k),
                      ram=TierProfile(capacity=ram, read_bw=k.ram_read_bw),
                      ssd=TierProfile(capacity=ssd, read_bw=k.ssd_read_bw, op_latency_s=1e-4),
                      shared=TierProfile(capacity=shared, read_bw=k.shared_read_bw, op_latency_s=1e-3))


def knobs_of(data: dict, args: argparse.Namespace) -> Knobs:
    from kvtier.config import KvtierConfig
    d = SimProfile()
    sources: dict[str, str] = {}

    def pick(name: str, cli: Any, keys: tuple[str, ...], default: Any) -> Any:
        if cli is not None:
            sources[name] = "command line"
            return cli
        v = find(data, *keys)
        if v is not None:
            sources[name] = "measured file"
            return v
        sources[name] = "default"
        return default

    budget = find(data, "step_budget")
    if isinstance(budget, dict):
        budget = budget.get("tokens")
    chunk_default = KvtierConfig().store.chunk_size
    return Knobs(
        kv_bytes_per_token=int(pick("kv_bytes_per_token", args.kv_bytes_per_token, ("kv_bytes_per_token",),
                                    _model_kv_bytes(data))),
        block_size=int(pick("block_size", args.block_size, ("block_size",), 128)),
        max_num_batched_tokens=int(pick("max_num_batched_tokens", args.max_num_batched_tokens,
                                        ("max_num_batched_tokens",), budget or 2048)),
        chunk_size=int(pick("chunk_size", args.chunk_size, ("chunk_size", "chunk_tokens"), chunk_default)),
        ram_read_bw=float(pick("ram_read_bw", args.ram_read_bw, ("ram_read_bw",), d.ram.read_bw)),
        ssd_read_bw=float(pick("ssd_read_bw", args.ssd_read_bw, ("ssd_read_bw",), d.ssd.read_bw)),
        shared_read_bw=float(pick("shared_read_bw", args.shared_read_bw, ("shared_read_bw",), d.shared.read_bw)),
        sources=sources)


def _model_kv_bytes(data: dict) -> int:
    """The bundled model's KV bytes per token in the run's dtype (float32 when unnamed: AVX2)."""
    from kvtier.compute import kv_bytes_per_token
    from kvtier.model import default_model_path
    dtype = find(data, "dtype") or "float32"
    try:
        return kv_bytes_per_token(default_model_path(), dtype)
    except (OSError, KeyError, ValueError) as e:
        raise ValidationInputError(f"the bundled model's KV size is unknown ({e}); give --kv-bytes-per-token") from None


def load_of(run: dict) -> LoadSpec:
    ld = run.get("load") or {}
    mode = ld.get("mode", "closed")
    return LoadSpec(mode=mode, concurrency=int(ld.get("concurrency") or 1),
                    think_time_scale=float(ld.get("think_time_scale", 1.0)),
                    rate=ld.get("rate"), time_scale=float(ld.get("time_scale", 1.0)))


def err_row(run: dict, sim, replicas: int) -> dict:
    mh, sh = run.get("token_hit_rate"), sim.token_hit_rate
    mt, st = run.get("ttft_mean_s"), sim.ttft_mean_s
    hit_err = None if mh is None or sh is None else sh - mh
    tt = run.get("tier_tokens") or {}
    tot = sum(float(v or 0) for v in tt.values())
    meas_share = {k: (float(tt.get(k) or 0) / tot * mh if tot and mh is not None else None)
                  for k in ("gpu", "ram", "ssd", "shared")}
    ttft_err = None if not mt or st is None else (st - mt) / mt
    meas_per = [int(p.get("requests", 0)) if isinstance(p, dict) else int(p) for p in run.get("per_replica", [])]
    return {"config": run["config"], "routing": run["routing"], "replicas": replicas,
            "measured": {k: run.get(k) for k in ("token_hit_rate", "ideal_hit_rate", "ttft_mean_s", "ttft_p50_s",
                                                 "ttft_p90_s", "requests", "tier_tokens",
                                                 "computed_tokens_per_request")}
            | {"per_replica_requests": meas_per, "tier_hit_rate": meas_share},
            "simulated": {"token_hit_rate": sh, "ttft_mean_s": st, "ttft_p50_s": sim.ttft_p50_s,
                          "ttft_p90_s": sim.ttft_p90_s, "requests": sim.requests, "tier_hit_rate": sim.tier_hit_rate,
                          "computed_tokens_per_request": sim.computed_tokens_per_request,
                          "per_replica_requests": [p.requests for p in sim.per_replica],
                          "shared_bytes_read": sim.shared_bytes_read},
            "hit_rate_error_points": hit_err, "ttft_mean_error": ttft_err,
            "ttft_p90_error": (None if not run.get("ttft_p90_s") or sim.ttft_p90_s is None
                               else (sim.ttft_p90_s - run["ttft_p90_s"]) / run["ttft_p90_s"]),
            "hit_ok": hit_err is not None and abs(hit_err) <= HIT_POINTS,
            "ttft_ok": ttft_err is not None and abs(ttft_err) <= TTFT_REL}


def validate(measured: Path, args: argparse.Namespace) -> dict:
    try:
        data = json.loads(measured.read_text())
    except (OSError, ValueError) as e:
        raise ValidationInputError(f"cannot read {measured}: {e}") from None
    for key in ("replicas", "workload", "runs"):
        if key not in data:
            raise ValidationInputError(f"{measured}: no {key!r}")
    from kvtier.sim.trace import load_workload_trace
    from kvtier.workload.tokens import load_tokenizer
    k = knobs_of(data, args)
    pp = calibration_of(measured, data)
    tok = (None if args.tokenizer == "approx"
           else load_tokenizer(None if args.tokenizer == "default" else args.tokenizer))
    trace = load_workload_trace(resolve(measured, data["workload"]), unit_tokens=k.block_size, tokenizer=tok)
    n = int(data["replicas"])
    ideal = ideal_hit_rate(trace, k)
    assignment = None
    if args.sticky_hash == "haproxy" and any(r["routing"] == "sticky" for r in data["runs"]):
        from benchmarks.cluster.haproxy_assignment import haproxy_assignment
        names = [p.get("name", f"r{i}") for i, p in enumerate(data["runs"][0].get("per_replica") or [])]
        assignment = haproxy_assignment(trace.conv_ids, n, names if len(names) == n else None)
    rows = []
    for run in data["runs"]:
        t0 = time.time()
        sim = run_cluster(trace, profile_for(run, pp, k), load_of(run), n, run["routing"],
                          sticky_assignment=assignment)
        rows.append(err_row(run, sim, n) | {"wall_s": round(time.time() - t0, 2)})
    return {"measured_file": str(measured), "machine": data.get("machine"), "replicas": n,
            "workload": data["workload"], "requests_in_workload": trace.num_requests, "knobs": k.__dict__,
            "history": data.get("history"), "sticky_hash": args.sticky_hash if assignment is not None else "sdbm",
            "ideal_hit_rate_simulated_trace": ideal,
            "engine": engine_from(pp, 1, k).model_dump(), "targets": {"hit_rate_points": HIT_POINTS,
                                                                   "ttft_mean_relative": TTFT_REL},
            "rows": rows, "all_ok": all(r["hit_ok"] and r["ttft_ok"] for r in rows)}


def ideal_hit_rate(trace, k: Knobs) -> float:
    """The workload's ideal (infinite cache) hit rate as the simulator tokenized it (a check that the
    simulated prompts are the measured ones: the demo reports its own)."""
    from kvtier.sim.stackdist import access_stream, miss_ratio_curve
    chunk_bytes = max(1, k.chunk_size // trace.unit_tokens) * trace.unit_tokens * k.kv_bytes_per_token
    return float(miss_ratio_curve(access_stream(trace, k.chunk_size), chunk_bytes).ideal_hit_rate)


def _share(d: dict) -> str:
    return " / ".join(_p(d.get(t)) for t in ("gpu", "ram", "ssd", "shared"))


def _p(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def render(rep: dict) -> str:
    m = rep.get("machine") or {}
    cpu = m.get("cpu") or m.get("cpu_model") or "?"
    out = [f"# Cluster simulator vs measured `kvtier demo cluster` ({rep['replicas']} replicas)", "",
           f"Measured: `{rep['measured_file']}` on {cpu} ({m.get('cpu_capability', '?')}, {m.get('cpus', '?')} vCPU); "
           f"workload `{rep['workload']}` ({rep['requests_in_workload']} requests, history "
           f"{rep.get('history') or '?'}: the simulation uses the workload's text). Profile from the run's own "
           "calibration, nothing fitted to the cluster runs. Targets: hit rate within "
           f"{HIT_POINTS * 100:.0f} points, TTFT mean within {TTFT_REL:.0%}.", "",
           f"Ideal hit rate of the workload as simulated: {_p(rep['ideal_hit_rate_simulated_trace'])} (measured: "
           f"{_p(rep['rows'][0]['measured']['ideal_hit_rate']) if rep['rows'] else '–'}).", "",
           "| config | routing | hit rate meas / sim | error (points) | TTFT mean meas / sim (s) | error | "
           "TTFT p90 meas / sim (s) | vLLM / RAM / SSD / shared meas; sim | requests per replica meas / sim | "
           "within targets |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        me, si = r["measured"], r["simulated"]
        he = r["hit_rate_error_points"]
        te = r["ttft_mean_error"]
        out.append(f"| {r['config']} | {r['routing']} | {_p(me['token_hit_rate'])} / {_p(si['token_hit_rate'])} | "
                   f"{'–' if he is None else f'{he * 100:+.1f}'} | "
                   f"{_s(me['ttft_mean_s'])} / {_s(si['ttft_mean_s'])} | "
                   f"{'–' if te is None else f'{te:+.1%}'} | {_s(me['ttft_p90_s'])} / {_s(si['ttft_p90_s'])} | "
                   f"{_share(me['tier_hit_rate'])}; {_share(si['tier_hit_rate'])} | "
                   f"{me['per_replica_requests']} / {si['per_replica_requests']} | "
                   f"{'yes' if r['hit_ok'] and r['ttft_ok'] else 'no'} |")
    src = ", ".join(f"{k} {v} ({rep['knobs']['sources'][k]})" for k, v in rep["knobs"].items() if k != "sources")
    out += ["", f"Knobs: {src}.", "", f"All within targets: {'yes' if rep['all_ok'] else 'no'}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", type=Path, help="the demo's --json file (or a folder holding one)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--tokenizer", default="default", help="'default' (the bundled model's), 'approx' or a folder")
    ap.add_argument("--kv-bytes-per-token", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--chunk-size", type=int)
    ap.add_argument("--ram-read-bw", type=float)
    ap.add_argument("--ssd-read-bw", type=float)
    ap.add_argument("--shared-read-bw", type=float)
    ap.add_argument("--sticky-hash", choices=("haproxy", "sdbm"), default="haproxy",
                    help="sticky runs: the map a real HAProxy makes (default) or the simulator's sdbm mod N")
    args = ap.parse_args(argv)
    measured = args.measured
    if measured.is_dir():
        found = [p for p in sorted(measured.glob("*.json")) if '"runs"' in p.read_text()[:1_000_000]]
        if not found:
            print(f"error: no demo cluster JSON (with 'runs') in {measured}", file=sys.stderr)
            return 2
        measured = found[0]
    try:
        rep = validate(measured, args)
    except (ValidationInputError, ValueError, KeyError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation.json").write_text(json.dumps(rep, indent=1, default=float) + "\n")
    text = render(rep)
    (args.out / "validation.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
