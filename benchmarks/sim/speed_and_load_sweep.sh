#!/usr/bin/env bash
# The simulator's timed runs, one after the other on an otherwise idle machine:
# 1. bench_speed.py (Mooncake trace, 12K x 12K tokens, 1M requests) under /usr/bin/time -v;
# 2. published_study.py --load-sweep (TTFT ratios vs the arrival rate).
# Run from anywhere: bash benchmarks/sim/speed_and_load_sweep.sh  (PY=... picks the interpreter,
# CPU_CLASS=avx2|avx512|amx names the output folder).
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD
S=${SPEED_OUT:-benchmarks/results/simulator/$(date -u +%F)-${CPU_CLASS:-unknown}/speed}
G=${SWEEP_OUT:-benchmarks/results/simulator/$(date -u +%F)-${CPU_CLASS:-unknown}/published-study-load-sweep}
mkdir -p "$S" "$G"
{
  date -u; uptime; ps -eo pid,ni,pcpu,etime,comm --sort=-pcpu | head -6
  /usr/bin/time -v timeout 600 "$PY" benchmarks/sim/bench_speed.py --json "$S/speed.json" 2>&1 \
    | grep -v -E "Page size|Socket|Signals|Swaps|File system|Average (shared|unshared|stack|total)|Exit status"
  uptime; date -u
} > "$S/bench.txt" 2>&1
{
  date -u; uptime
  timeout 600 "$PY" benchmarks/sim/published_study.py --out "$G" --load-sweep 1.1 1.4 1.5 1.6 1.7 1.8 2.0
  uptime; date -u
} > "$G/sweep.txt" 2>&1
