#!/usr/bin/env bash
# The model step of scripts/setup.sh timed as on a fresh machine: byte-compiling the environment (into a
# separate PYTHONPYCACHEPREFIX, so nothing is reused) beside converting the bundled models into a temporary
# kvtier home. "old": SmolLM2 only; "new": SmolLM2 and gemma-3-270m, one process each. Run under the heavy lock.
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
step() {  # $1 label, rest: model names
  label=$1; shift
  W=/tmp/setup-measure/$label; rm -rf $W; mkdir -p $W
  t0=$(date +%s.%N)
  pids=()
  for m in "$@"; do KVTIER_HOME=$W/home KVTIER_MODEL_DIR=$W/home/models/SmolLM2-135M-Instruct $PY -m kvtier.models $m > $W/$m.log 2>&1 & pids+=($!); done
  PYTHONPYCACHEPREFIX=$W/pyc $PY -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  PYTHONPYCACHEPREFIX=$W/pyc $PY -m compileall -q -j 0 kvtier >/dev/null 2>&1 || true
  t1=$(date +%s.%N)
  for p in "${pids[@]}"; do wait $p; done
  t2=$(date +%s.%N)
  echo "$label: compileall done at $(echo "$t1-$t0" | bc) s, step done at $(echo "$t2-$t0" | bc) s"
  tail -n 1 $W/*.log
  rm -rf $W
}
step old smollm2
step new smollm2 gemma3
