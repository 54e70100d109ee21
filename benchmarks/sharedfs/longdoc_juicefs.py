"""`kvtier demo longdoc` with its shared-filesystem column on a real two-mount JuiceFS volume.

    .venv/bin/python benchmarks/sharedfs/longdoc_juicefs.py [--quick] \
        --json /tmp/longdoc-sharedfs.json

Servers 1-2 (recompute, RAM hit, SSD hit) write the shared tier through mount "a"; server 3 is a
fresh process with empty local tiers reading through mount "b" (its own client cache).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, cpu_name, juicefs_volume


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    print(f"# CPU: {cpu_name()}", flush=True)
    with juicefs_volume() as (fs, _meta):
        m1, m2 = fs.mount("a"), fs.mount("b")
        (m1.path / "kv").mkdir()
        while not (m2.path / "kv").is_dir():
            time.sleep(0.05)
        argv = [sys.executable, "-m", "kvtier.cli", "demo", "longdoc", "--sharedfs", str(m1.path / "kv"),
                "--sharedfs-read", str(m2.path / "kv"), "--json", str(a.json.resolve()),
                *(["--quick"] if a.quick else [])]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        return subprocess.run(argv, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
