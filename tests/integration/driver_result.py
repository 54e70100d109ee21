"""Wait for a driver subprocess and read its JSON result (shared by the real-vLLM tests).

A driver that exits non-zero or runs past its timeout fails the test with the tail of its stderr;
a timed-out driver is killed (its process group too when ``killpg`` is given) before the error.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable


def driver_result(proc: subprocess.Popen, result: Path, stderr: Path, label: str, timeout: float,
                  killpg: Callable[[subprocess.Popen], None] | None = None) -> dict:
    """Wait up to ``timeout`` s for ``proc``; return the JSON in ``result`` or raise AssertionError."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = -9
        if killpg is None:
            proc.kill()
            proc.wait()
    finally:
        if killpg is not None:
            killpg(proc)
    if rc != 0:
        tail = stderr.read_text(errors="replace")[-4000:] if stderr.exists() else "(no stderr)"
        raise AssertionError(f"{label} failed ({rc}):\n{tail}")
    return json.loads(result.read_text())
