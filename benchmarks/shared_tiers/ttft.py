"""`kvtier bench ttft` with a hit from every shared backend, on real servers started here.

    timeout 600 .venv/bin/python benchmarks/shared_tiers/ttft.py --phase write \
        --workdir /var/tmp/kvtier-ttft-shared
    timeout 600 .venv/bin/python benchmarks/shared_tiers/ttft.py --phase read \
        --workdir /var/tmp/kvtier-ttft-shared --json /tmp/ttft-shared.json --md /tmp/ttft-shared.md

One measurement split into two jobs of < 10 minutes each on a 2-core CPU (``--resume``):

* ``write``: vanilla vLLM (cold, prefix-cache hit) and the kvtier writer (cold = miss, RAM hit);
* ``read``: starts a JuiceFS volume (metadata in Valkey, data in a local directory) mounted twice
  ("machine A" writes through mount a, "machine B" reads through mount b with its own cache dir),
  a Valkey server and a Mooncake master + standalone pool owner (all on 127.0.0.1, from
  tests/services), then runs the kvtier SSD reader and one fresh reader engine per backend with
  empty RAM and no SSD. Each backend is filled from the writer's SSD chunk files through the
  backend tier's own ``put`` (kvtier/bench/shared_seed.py); the JuiceFS data directory leaves the
  page cache before each hit. Every hit row is checked (kvtier/bench/ttft_check.py).
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

from services import services  # noqa: E402


def kvtier(args: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "ttft", *args]
    print("+ kvtier bench ttft " + " ".join(args), flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("write", "read"), required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--repeats", default="3,2,1")
    ap.add_argument("--backends", default="sharedfs,valkey,mooncake")
    ap.add_argument("--pool-gib", type=float, default=1.5, help="Mooncake pool size")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--diag", action="store_true", help="profiled extra hits (kvtier bench ttft --diag)")
    a = ap.parse_args()
    common = ["--lengths", a.lengths, "--repeats", a.repeats, "--workdir", str(a.workdir), "--no-example",
              "--no-peers", "--resume", *(["--diag"] if a.diag else []),
              *(["--json", str(a.json)] if a.json else []), *(["--md", str(a.md)] if a.md else [])]
    if a.phase == "write":
        return kvtier(["--roles", "vanilla,kvtier-w", *common])
    which = {b.strip() for b in a.backends.split(",") if b.strip()}
    roles = ",".join(["kvtier-r", *(f"shared-r:{k}" for k in ("sharedfs", "valkey", "mooncake") if k in which)])
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-svc-") as tmp, \
            services(Path(tmp), int(a.pool_gib * 2**30), which) as ep:
        return kvtier(["--roles", roles, *ep.ttft_options(), *common])


if __name__ == "__main__":
    sys.exit(main())
