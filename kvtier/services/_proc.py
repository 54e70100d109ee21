"""Small process helpers shared by the local services (127.0.0.1 only): tests and the cluster demo.

Side-effect free at import. Servers are started by their caller (a test, a demo) and
stopped by it (fixtures and demos stop them even after a failure)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from kvtier.ports import HOST


class ServiceMissing(RuntimeError):
    """A binary or library a test service needs is not installed (fixtures turn this into a failure)."""


def venv_bin(name: str, hint: str) -> str:
    """``name`` next to this interpreter (the venv's bin/) or on PATH; ServiceMissing otherwise."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise ServiceMissing(f"{name} not found (next to {sys.executable} or on PATH): {hint}")


def wait_until(check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None,
               log: Path | None = None, interval: float = 0.05) -> None:
    """Poll ``check`` until True; RuntimeError naming ``what`` (with the log tail) on timeout or exit."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}{log_tail(log)}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f}s{log_tail(log)}")


def log_tail(log: Path | None, n: int = 15) -> str:
    if log is None or not log.exists():
        return ""
    lines = log.read_text(errors="replace").splitlines()[-n:]
    return "\n  log tail:\n  " + "\n  ".join(lines)


def spawn(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own process group, stdout+stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def port_open(port: int, host: str = HOST) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def signal_proc(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_proc(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGCONT (in case it was paused), SIGTERM, then SIGKILL after ``timeout``; reaps it."""
    if proc is None:
        return
    if proc.poll() is None:
        signal_proc(proc, signal.SIGCONT)
        signal_proc(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            signal_proc(proc, signal.SIGKILL)
            proc.wait(timeout)
    else:
        proc.wait()


def kill_proc(proc: subprocess.Popen | None) -> None:
    """SIGKILL (no clean shutdown) and reap."""
    if proc is None:
        return
    signal_proc(proc, signal.SIGCONT)
    signal_proc(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
