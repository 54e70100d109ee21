"""The shared-backend measurements that need the servers, in ONE heavy job (one set of servers):
the `bench ttft` read phase (ttft.py --phase read: kvtier SSD reader + one fresh reader engine per
backend) and then `kvtier demo longdoc --shared ...` (longdoc.py), each on its own directory /
key space of the same servers.

    timeout 600 .venv/bin/python benchmarks/shared_tiers/read_all.py \
        --workdir /var/tmp/kvtier-ttft-shared --ttft-json T.json --ttft-md T.md \
        --longdoc-out /tmp/longdoc-shared --longdoc-json L.json [--full-longdoc]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from services import services  # noqa: E402


def run(argv: list[str]) -> int:
    print("+ kvtier " + " ".join(argv), flush=True)
    t0 = time.time()
    rc = subprocess.run([sys.executable, "-m", "kvtier.cli", *argv], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                        cwd=ROOT).returncode
    print(f"# rc={rc} in {time.time() - t0:.0f} s", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True, help="the bench ttft work directory of the write phase")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--repeats", default="3,2,1")
    ap.add_argument("--ttft-json", type=Path, default=None)
    ap.add_argument("--ttft-md", type=Path, default=None)
    ap.add_argument("--longdoc-out", type=Path, default=Path("/tmp/kvtier-longdoc-shared"))
    ap.add_argument("--longdoc-json", type=Path, default=None)
    ap.add_argument("--full-longdoc", action="store_true", help="the full demo (3 documents of ~7.6K tokens)")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-longdoc", action="store_true")
    ap.add_argument("--diag", action="store_true", help="bench ttft --diag (the writer must have run with it)")
    ap.add_argument("--pool-gib", type=float, default=2.0)
    a = ap.parse_args()
    kinds = ["sharedfs", "valkey", "mooncake"]
    rc = 0
    with tempfile.TemporaryDirectory(prefix="kvtier-shared-svc-") as tmp, \
            services(Path(tmp), int(a.pool_gib * 2**30), set(kinds)) as ep:
        if not a.skip_ttft:
            roles = ",".join(["kvtier-r", *(f"shared-r:{k}" for k in kinds)])
            rc |= run(["bench", "ttft", "--roles", roles, *ep.ttft_options(), "--lengths", a.lengths,
                       "--repeats", a.repeats, "--workdir", str(a.workdir), "--no-example", "--no-peers", "--resume",
                       *(["--diag"] if a.diag else []), *(["--json", str(a.ttft_json)] if a.ttft_json else []),
                       *(["--md", str(a.ttft_md)] if a.ttft_md else [])])
        if a.skip_longdoc:
            return rc
        for d in (ep.write_dir, ep.read_dir):             # the demo's own directory on the volume
            d.parent.joinpath("kv-longdoc").mkdir(exist_ok=True)
        ep.write_dir, ep.read_dir = ep.write_dir.parent / "kv-longdoc", ep.read_dir.parent / "kv-longdoc"
        rc |= run(["demo", "longdoc", *ep.longdoc_options(kinds), "--out", str(a.longdoc_out),
                   *(["--json", str(a.longdoc_json)] if a.longdoc_json else []),
                   *([] if a.full_longdoc else ["--quick"])])
    return rc


if __name__ == "__main__":
    sys.exit(main())
