#!/usr/bin/env bash
# The sharedfs lookup, scale and throughput measurements of docs/results.md, one after the other
# (run from the repo root): CPU_CLASS=avx2 benchmarks/sharedfs/run_all.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../../.venv/bin/python}
OUT=${OUT:-../results/sharedfs/$(date -u +%F)-${CPU_CLASS:-unknown}}
mkdir -p "$OUT"
"$PY" juicefs_bench.py --json "$OUT/juicefs.json"
"$PY" scale.py --juicefs --files 10000 100000 --json "$OUT/scale-juicefs.json"
"$PY" scale.py --local "${LOCAL_DIR:-/var/tmp/kvtier-sfs-scale}" --files 10000 100000 1000000 \
    --json "$OUT/scale-local.json"
