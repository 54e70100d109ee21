"""scripts/test.sh (`make test`): both suites run, the unit suite beside the integration suite, and the
exit status fails when either failed or collected nothing (a fake python stands in for pytest)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, integ_rc: int, unit_rc: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    # the unit run waits until the integration run has started: proves they run side by side
    fake.write_text(f"""#!/bin/bash
case "$*" in
  *"not integration"*) echo "unit $*" >> {calls}; for i in $(seq 100); do [ -f {tmp_path}/integ-started ] && break; sleep 0.05; done
                       echo "unit output line"; exit {unit_rc};;
  *) touch {tmp_path}/integ-started; echo "integ $*" >> {calls}; echo "integration output line"; exit {integ_rc};;
esac
""")
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "UNIT_LOG": str(tmp_path / "unit.log")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "--durations=3"], capture_output=True,
                          text=True, env=env, timeout=60)
    return proc, calls.read_text().splitlines()


@pytest.mark.parametrize("integ_rc,unit_rc,want", [(0, 0, 0), (1, 0, 1), (0, 1, 1), (0, 5, 5), (5, 0, 5), (2, 1, 2)])
def test_exit_status_fails_when_either_suite_fails(tmp_path, integ_rc, unit_rc, want):
    proc, calls = _run(tmp_path, integ_rc, unit_rc)
    assert proc.returncode == want, proc.stdout + proc.stderr
    assert sorted(c.split()[0] for c in calls) == ["integ", "unit"]
    integ = next(c for c in calls if c.startswith("integ"))
    unit = next(c for c in calls if c.startswith("unit"))
    assert "-m integration --durations=3" in integ and "-m not integration" in unit and "--durations=3" in unit
    out = proc.stdout
    assert "integration output line" in out and "unit output line" in out      # the unit log is printed
    assert out.index("integration output line") < out.index("unit output line")
    assert f"integration suite exited {integ_rc}" in out and f"unit suite exited {unit_rc}" in out


def test_the_unit_suite_is_niced(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\necho \"$* nice=$(nice)\" >> {tmp_path}/calls\n")
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "UNIT_LOG": str(tmp_path / "unit.log")}
    subprocess.run(["bash", str(ROOT / "scripts" / "test.sh")], env=env, timeout=60, check=True, capture_output=True)
    lines = (tmp_path / "calls").read_text().splitlines()
    base = int(subprocess.run(["nice"], capture_output=True, text=True).stdout)
    assert {line.split("nice=")[1] for line in lines if "not integration" in line} == {str(min(19, base + 19))}
    assert {line.split("nice=")[1] for line in lines if "not integration" not in line} == {str(base)}
