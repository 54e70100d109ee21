"""`kvtier demo longdoc --shared sharedfs,valkey,mooncake` on real backends started here.

    timeout 600 .venv/bin/python benchmarks/shared_tiers/longdoc.py [--quick] \
        --out /tmp/longdoc-shared --json /tmp/longdoc-shared/demo-longdoc-shared.json

The demo's recompute / RAM hit / SSD hit columns, then one column per backend: a fresh server
with empty local tiers (new RAM, no SSD) reading that backend ("another machine"; for JuiceFS
through the second mount, with the volume's data directory evicted from the page cache first).
Backends: see services.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from services import READER_MOUNT_OPTIONS, services  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None, help="the demo's bundled model (kvtier demo longdoc --model)")
    ap.add_argument("--backends", default="sharedfs,valkey,mooncake")
    ap.add_argument("--pool-gib", type=float, default=1.5, help="Mooncake pool size")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reader-cache", action="store_true",
                    help="mount b with JuiceFS's default block cache (default: none, services.READER_MOUNT_OPTIONS)")
    a = ap.parse_args()
    kinds = [b.strip() for b in a.backends.split(",") if b.strip()]
    with tempfile.TemporaryDirectory(prefix="kvtier-longdoc-svc-") as tmp, \
            services(Path(tmp), int(a.pool_gib * 2**30), set(kinds),
                     () if a.reader_cache else READER_MOUNT_OPTIONS) as ep:
        argv = [sys.executable, "-m", "kvtier.cli", "demo", "longdoc", *ep.longdoc_options(kinds),
                "--out", str(a.out), *(["--json", str(a.json.resolve())] if a.json else []),
                *(["--quick"] if a.quick else []), *(["--model", a.model] if a.model else [])]
        print("+ kvtier " + " ".join(argv[3:]), flush=True)
        return subprocess.run(argv, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
