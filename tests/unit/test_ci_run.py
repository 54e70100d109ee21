""".ci/run: exits with make's status (set-up or tests failing, no tests collected = failure) and times both."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ci(tmp_path: Path, setup_rc: int, test_rc: int) -> subprocess.CompletedProcess:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make = bin_dir / "make"
    make.write_text(f"#!/bin/sh\necho \"make $1\" >> {tmp_path}/calls\n"
                    f"[ \"$1\" = setup ] && exit {setup_rc}\n[ \"$1\" = test ] && exit {test_rc}\nexit 99\n")
    make.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VENV": str(tmp_path / "no-venv")}
    return subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("test_rc", [0, 1, 2, 5])
def test_ci_exit_code_is_make_tests_status(tmp_path, test_rc):
    proc = _ci(tmp_path, 0, test_rc)
    assert proc.returncode == test_rc, proc.stdout + proc.stderr
    assert (tmp_path / "calls").read_text().split("\n")[:2] == ["make setup", "make test"]
    assert f"[ci] make test exited {test_rc} after" in proc.stdout
    assert ("FAILED" in proc.stdout) == (test_rc != 0)


def test_ci_stops_when_setup_fails(tmp_path):
    proc = _ci(tmp_path, 2, 0)
    assert proc.returncode == 2
    assert (tmp_path / "calls").read_text().split() == ["make", "setup"]
    assert "FAILED: set-up" in proc.stdout
