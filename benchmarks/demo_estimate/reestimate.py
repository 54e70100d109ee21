"""Re-estimate recorded `kvtier demo` runs with the current sizing model and compare to what they took.

For each results folder (a `kvtier demo` --out, or its users<N>/ lighter point), regenerates the run's
workload from its recorded size, takes the run's own calibration (the folder's calibration.json, or its
parent's), and prints per configuration the measured replay seconds and mean TTFT beside:

* ``estimate``: what the current model says before the run (``kvtier.demo.sizing.estimate`` with the
  regime ``kvtier.demo.regime.regime_for`` chooses now: predicted hit rates, its engine KV space);
* ``at measured hits``: the closed loop (``kvtier.demo.closed_loop``) at the hit rate the
  configuration measured and the engine KV space it ran with (``budgets.engine_kv_tokens``), with and
  without the KV-space limit: the time model alone, apart from the hit-rate prediction.

Nothing is started; CPU only.

    .venv/bin/python benchmarks/demo_estimate/reestimate.py --model MODEL_DIR RESULTS_DIR [RESULTS_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the model folder (for its tokenizer)")
    ap.add_argument("runs", type=Path, nargs="+", help="demo results folders")
    args = ap.parse_args()

    from kvtier.demo import companion
    from kvtier.demo.calibrate import load_calibration
    from kvtier.demo.regime import regime_for
    from kvtier.demo.sizing import SLACK, LoopModel, estimate
    from kvtier.workload.tokens import load_tokenizer

    tok = load_tokenizer(args.model)
    for run in args.runs:
        demo = json.loads((run / "demo.json").read_text())
        cal_path = run / "calibration.json" if (run / "calibration.json").is_file() else run.parent / "calibration.json"
        if not cal_path.is_file():
            print(f"{run}: no calibration.json here or in its parent", file=sys.stderr)
            return 2
        prof = load_calibration(cal_path, demo.get("dtype")).profile
        size = companion.CompanionDemoSize(**demo["size"])
        history = demo.get("history", "live")
        facts = companion.generate(size, tok)[3]
        per_config = estimate(prof, 0.0, size, facts, history, regime_for(size, facts, prof, history))[1]
        kv = (demo.get("budgets") or {}).get("engine_kv_tokens")
        out = None if history == "live" else size.max_tokens
        compare = json.loads((run / "compare.json").read_text())
        summaries = {c["name"]: c["summary"] for c in compare["configs"] if c.get("summary")}
        for name, est in per_config.items():
            s = summaries.get(name) or {}
            m, hit = s.get("duration_s"), s.get("token_hit_rate")
            line = (f"{run.name:24s} {name:15s} users {size.concurrency:2d}  measured {m or 0:6.0f} s"
                    f"  estimate {est:6.0f} s  measured/estimate {m / est if m and est else float('nan'):.2f}")
            if hit is not None:
                lim = LoopModel(prof, facts, size.concurrency, size.think_time_scale, kv, facts.ideal_hit_rate, out)
                free = LoopModel(prof, facts, size.concurrency, size.think_time_scale, None, facts.ideal_hit_rate, out)
                a, b = lim.run(hit), free.run(hit)
                line += (f"  | at measured hits: {SLACK * a.makespan_s:5.0f} s (no KV limit {SLACK * b.makespan_s:5.0f} s),"
                         f" TTFT {a.mean_ttft() or 0:5.2f} s (no limit {b.mean_ttft() or 0:5.2f}) vs measured "
                         f"{s.get('ttft_mean_s') or 0:5.2f} s")
            print(line)
        parts = demo.get("calibration") or {}
        print(f"{run.name:24s} parts: calibration {parts.get('profile', {}).get('elapsed_s', 0):.0f} s, server start "
              f"{parts.get('startup_s', 0):.0f} s x 4; estimate recorded {demo['sizing']['estimate_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
