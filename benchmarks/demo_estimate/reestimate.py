"""Re-estimate recorded `kvtier demo` runs with the current sizing model and compare to what they took.

For each results folder (a `kvtier demo` --out, or its users<N>/ lighter point), regenerates the run's
workload from its recorded size, takes the run's own calibration (the folder's calibration.json, or its
parent's), and prints per configuration: measured replay seconds, the current model's estimate
(``kvtier.demo.sizing.estimate``), and measured / estimate. Nothing is started; CPU only.

    .venv/bin/python benchmarks/demo_estimate/reestimate.py --model MODEL_DIR RESULTS_DIR [RESULTS_DIR ...]

To compare with an earlier model, run it from a checkout of that commit (e.g. 7948aaa, the model before the decode term was fixed, vs f4ac6b5).
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
    from kvtier.demo.sizing import estimate
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
        facts = companion.generate(size, tok)[3]
        per_config = estimate(prof, 0.0, size, facts, demo.get("history", "live"))[1]
        compare = json.loads((run / "compare.json").read_text())
        measured = {c["name"]: c["summary"]["duration_s"] for c in compare["configs"] if c.get("summary")}
        for name, est in per_config.items():
            m = measured.get(name)
            ratio = f"{m / est:.2f}" if m and est else "-"
            print(f"{run.name:48s} {name:15s} users {size.concurrency:2d}  measured {m or 0:6.0f} s  "
                  f"estimate {est:6.0f} s  measured/estimate {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
