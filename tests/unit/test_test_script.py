"""scripts/test.sh (`make test`): the unit suite (on every core when pytest-xdist is there), then the
integration suite, one at a time and at the caller's priority; both always run, and the exit status
fails when either failed or collected nothing (a fake python stands in for pytest)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fake_python(tmp_path: Path, integ_rc: int, unit_rc: int, xdist: bool = True) -> Path:
    """A python that logs each pytest run's start and end (with its arguments and nice value) and exits
    with the given status; each run sleeps a little so overlapping runs would interleave in the log.
    ``python -c ...`` (the script's probe for pytest-xdist) succeeds when ``xdist``."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
[ "$1" = "-c" ] && exit {0 if xdist else 1}
case "$*" in
  *"not integration"*) kind=unit; rc={unit_rc};;
  *) kind=integ; rc={integ_rc};;
esac
echo "start $kind nice=$(nice) $*" >> {calls}
sleep 0.3
echo "$kind output line"
echo "end $kind" >> {calls}
exit $rc
""")
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, integ_rc: int, unit_rc: int, xdist: bool = True,
         workers: str = "2") -> tuple[subprocess.CompletedProcess, list[str]]:
    fake = _fake_python(tmp_path, integ_rc, unit_rc, xdist)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "--durations=3"], capture_output=True,
                          text=True, env={**os.environ, "PY": str(fake), "UNIT_WORKERS": workers}, timeout=60)
    return proc, (tmp_path / "calls").read_text().splitlines()


@pytest.mark.parametrize("integ_rc,unit_rc,want", [(0, 0, 0), (1, 0, 1), (0, 1, 1), (0, 5, 5), (5, 0, 5), (2, 1, 2)])
def test_exit_status_fails_when_either_suite_fails(tmp_path, integ_rc, unit_rc, want):
    proc, calls = _run(tmp_path, integ_rc, unit_rc)
    assert proc.returncode == want, proc.stdout + proc.stderr
    out = proc.stdout
    assert "integ output line" in out and "unit output line" in out     # a failed unit suite still runs integration
    assert f"integration suite exited {integ_rc}" in out and f"unit suite exited {unit_rc}" in out


def test_unit_suite_runs_first_and_alone(tmp_path):
    _, calls = _run(tmp_path, 0, 0)
    assert [c.split()[0] + " " + c.split()[1] for c in calls] == ["start unit", "end unit", "start integ", "end integ"]
    unit, integ = calls[0], calls[2]
    assert "-m not integration" in unit and "--durations=3" in unit
    assert "-m integration --durations=3" in integ


@pytest.mark.parametrize("xdist,workers,want", [(True, "2", "-n 2 "), (True, "1", ""), (False, "2", "")])
def test_unit_suite_uses_a_worker_per_core_when_it_can(tmp_path, xdist, workers, want):
    _, calls = _run(tmp_path, 0, 0, xdist, workers)
    unit, integ = calls[0], calls[2]
    assert f"-p no:cacheprovider {want}--durations=3" in unit, unit
    assert "-n " not in integ                                           # the integration suite: one process


def test_neither_suite_is_niced(tmp_path):
    """A niced unit suite beside the integration suite starved CPU-heavy tests past their bound (seen in CI)."""
    _, calls = _run(tmp_path, 0, 0)
    base = subprocess.run(["nice"], capture_output=True, text=True).stdout.strip()
    assert {c.split()[2] for c in calls if c.startswith("start")} == {f"nice={base}"}
