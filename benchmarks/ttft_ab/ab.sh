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
    rm -rf "$work"
  done
done
.venv/bin/python - "$out" <<'PYEOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*-*.json")):
    side = f.stem.split("-")[0]
    for r in json.loads(f.read_text()).get("rows", []):
        for k in ("kvtier_ssd_s", "kvtier_ram_s", "kvtier_miss_s"):
            if r.get(k) is not None:
                rows.setdefault((side, k), []).append(r[k])
lines = ["| figure | old (median of rounds) | new | new / old |", "|---|---:|---:|---:|"]
for k in ("kvtier_ssd_s", "kvtier_ram_s", "kvtier_miss_s"):
    o, n = rows.get(("old", k)), rows.get(("new", k))
    if o and n:
        mo, mn = statistics.median(o), statistics.median(n)
        lines.append(f"| {k} | {mo:.3f} s ({', '.join(f'{x:.3f}' for x in o)}) | {mn:.3f} s "
                     f"({', '.join(f'{x:.3f}' for x in n)}) | {mn / mo:.3f} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
