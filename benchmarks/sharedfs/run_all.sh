#!/usr/bin/env bash
# All sharedfs measurements of docs/results.md, one heavy job at a time (run from the repo root):
#   flock /tmp/kvtier-heavy.lock benchmarks/sharedfs/run_all.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../../.venv/bin/python}
OUT=../results
"$PY" juicefs_bench.py --json "$OUT/sharedfs-juicefs.json"
"$PY" scale.py --juicefs --files 10000 100000 --json "$OUT/sharedfs-scale-juicefs.json"
"$PY" scale.py --local "${LOCAL_DIR:-/var/tmp/kvtier-sfs-scale}" --files 10000 100000 1000000 \
    --json "$OUT/sharedfs-scale-local.json"
