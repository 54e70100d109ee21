#!/usr/bin/env bash
# Session 6's timed simulator runs, one after another under the heavy-job lock (run as:
#   flock /tmp/kvtier-heavy.lock bash benchmarks/sim/window_s6.sh):
# 1. bench_speed.py (Mooncake trace, 12K x 12K tokens, 1M requests), quiet;
# 2. published_study.py --load-sweep (TTFT ratios vs the arrival rate).
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-/work/main/.venv/bin/python}
export PYTHONPATH=$PWD     # this checkout's kvtier (the venv's editable install points at /work/main)
S=benchmarks/results/sim-speed-2026-12-01-s6
G=benchmarks/results/sim-gpu-study-2026-12-01-s6
mkdir -p "$S" "$G"
{
  date -u; uptime; ps -eo pid,ni,pcpu,etime,comm --sort=-pcpu | head -6
  /usr/bin/time -v timeout 600 "$PY" benchmarks/sim/bench_speed.py --json "$S/speed.json" 2>&1 \
    | grep -v -E "Page size|Socket|Signals|Swaps|File system|Average (shared|unshared|stack|total)|Exit status"
  uptime; date -u
} > "$S/bench.log" 2>&1
{
  date -u; uptime
  timeout 600 "$PY" benchmarks/sim/published_study.py --out "$G" --load-sweep 1.1 1.4 1.5 1.6 1.7 1.8 2.0
  uptime; date -u
} > "$G/sweep.log" 2>&1
