"""A real permission-denied cache directory: the store serves without the SSD tier, one counted event.

CI runs as root, which no file mode stops, so the store is opened in a child process that imports
kvtier and then drops to the unprivileged ``nobody`` (uid/gid 65534); the SSD directory lies below
pytest's root-only (0700) temporary directory, so creating or opening it fails with EACCES. Run as
a non-root user the same check uses a directory of mode 0500 in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, os, sys
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import TieredStore
import kvtier.tiers.disk, kvtier.tiers.memory    # imported while the interpreter's files are readable
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
path = sys.argv[1]
try:
    os.makedirs(path)
    made = "created"
except PermissionError:
    made = "EACCES"
except FileExistsError:
    made = "exists"
cfg = StoreConfig.model_validate({"chunk_size": 4, "memory": {"capacity": 10**6},
                                  "disk": {"enabled": True, "path": path}})
ns = Namespace("m", "f", "float32", "L", 4, 4)
key = chunk_keys(ns, list(range(4)))[0]
payload = bytes(range(64))
with TieredStore.open(cfg, ns) as s:
    stored = s.put(key, None, payload, num_tokens=4, shape=(64,), dtype="uint8")
    got = s.get(key)
    print(json.dumps({"made": made, "uid": os.geteuid(), "disk": s.tier("disk") is not None,
                      "memory": s.tier("memory") is not None, "stored": bool(stored),
                      "read_back": got is not None and bytes(got) == payload,
                      "events": {k.removeprefix("events."): v for k, v in s.stats()["counters"].items()
                                 if k.startswith("events.")}}))
"""


def _run_child(path: Path) -> dict:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "HOME": "/tmp"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_permission_denied_cache_directory_is_skipped_with_one_event(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "ssd"
    else:
        os.chmod(tmp_path, 0o700)           # root-only: nobody cannot even look inside
        target = tmp_path / "ssd"
    r = _run_child(target)
    assert r["made"] == "EACCES", r                     # the fault is real, not simulated
    if os.geteuid() == 0:
        assert r["uid"] == 65534
    assert (r["disk"], r["memory"]) == (False, True)
    assert r["events"] == {"tier_unavailable": 1}
    assert r["stored"] and r["read_back"]               # serving continues from RAM


def test_the_same_directory_is_used_when_permitted(tmp_path: Path) -> None:
    """Control: the child's path to the SSD tier works when nothing forbids it (so the test above
    fails for the permission, not for the child's set-up)."""
    if os.geteuid() == 0:
        open_dir = Path("/tmp") / f"kvtier-perm-ok-{os.getpid()}"
        open_dir.mkdir(mode=0o777, exist_ok=True)
        os.chmod(open_dir, 0o777)
        target = open_dir / "ssd"
    else:
        target = tmp_path / "ssd"
    try:
        r = _run_child(target)
    finally:
        if os.geteuid() == 0:
            import shutil
            shutil.rmtree(open_dir, ignore_errors=True)
    assert r["made"] == "created" and r["disk"] and r["events"] == {}
    assert r["stored"] and r["read_back"]


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uid switching is Linux-only here")
