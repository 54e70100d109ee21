#!/usr/bin/env bash
# SSD-hit TTFT of an older kvtier commit against the checkout, in alternating runs of the same
# `kvtier bench ttft` (writer engine: cold prefill + RAM hit; reader engine: SSD hit in a fresh process).
# Usage: benchmarks/ttft_ab/ab.sh OLD_REF OUT_DIR [LENGTH] [REPEATS] [ROUNDS]
# The old commit runs from a git worktree in the checkout's venv; a sitecustomize.py first on PYTHONPATH
# drops the editable install's import hook so every process of its engines imports the old kvtier.
set -euo pipefail
cd "$(dirname "$0")/../.."
old_ref=${1:?old commit}; out=${2:?output folder}; length=${3:-7424}; repeats=${4:-3}; rounds=${5:-2}
mkdir -p "$out"; out=$(cd "$out" && pwd)
old=$(mktemp -d); hook=$(mktemp -d)
trap 'git worktree remove --force "$old" >/dev/null 2>&1 || true; rm -rf "$hook"' EXIT
git worktree add -f --detach "$old" "$old_ref" >/dev/null
cat > "$hook/sitecustomize.py" <<'PYEOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
for name in [m for m in sys.modules if m == "kvtier" or m.startswith("kvtier.")]:
    del sys.modules[name]
PYEOF
bench=(bench ttft --lengths "$length" --repeats "$repeats" --roles kvtier-w,kvtier-r --no-example --no-peers)
echo "old $(git rev-parse --short "$old_ref"), new $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + changes'); $(nproc) CPUs" \
  | tee "$out/runs.txt"
for round in $(seq 1 "$rounds"); do
  for side in old new; do
    if [ "$side" = old ]; then pp="$hook:$old"; else pp=""; fi
    work=$(mktemp -d)
    start=$(date +%s)
    PYTHONPATH="$pp" .venv/bin/kvtier "${bench[@]}" --workdir "$work" --json "$out/$side-$round.json" \
      --md "$out/$side-$round.md" > "$out/$side-$round.out" 2>&1 || echo "$side round $round failed" | tee -a "$out/runs.txt"
    echo "$side round $round: $(( $(date +%s) - start )) s" | tee -a "$out/runs.txt"
    for role in kvtier-w kvtier-r; do cp "$work/$role.json" "$out/$side-$round-$role.json" 2>/dev/null || true; done
    rm -rf "$work"
  done
done
.venv/bin/python - "$out" "$length" <<'PYEOF'
# Every sample of every round (the role files), per side: TTFT of an SSD hit (fresh engine), a RAM hit, a
# miss (cold), and the connector's own load time in each SSD hit (its load-seconds counter, per sample).
import json, pathlib, statistics, sys
out, length = pathlib.Path(sys.argv[1]), sys.argv[2]
samples = {}
for f in sorted(out.glob("*-*-kvtier-*.json")):
    side = f.name.split("-")[0]
    for kind, values in json.loads(f.read_text()).get("rows", {}).get(length, {}).items():
        for v in values if isinstance(values, list) else []:
            samples.setdefault((side, kind), []).append(v["s"])
            if kind == "ssd_hit":
                load = v.get("kvtier", {}).get("kvtier_connector_load_seconds_sum")
                if load is not None:
                    samples.setdefault((side, "ssd_hit: load alone"), []).append(load)
lines = [f"{length}-token prompts; every sample of every round.", "",
         "| figure | old: median (n, min-max) | new: median (n, min-max) | new / old (medians) |", "|---|---:|---:|---:|"]
for kind in ("ssd_hit", "ssd_hit: load alone", "ram_hit", "cold"):
    o, n = samples.get(("old", kind)), samples.get(("new", kind))
    if o and n:
        mo, mn = statistics.median(o), statistics.median(n)
        lines.append(f"| {kind} | {mo:.3f} s ({len(o)}, {min(o):.3f}-{max(o):.3f}) | {mn:.3f} s ({len(n)}, "
                     f"{min(n):.3f}-{max(n):.3f}) | {mn / mo:.3f} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
