"""The disk tier's on-disk layout and its ledger lock — one implementation, used by
``DiskTier`` (kvtier/tiers/disk.py) and by ``kvtier fsck`` (kvtier/tiers/fsck.py).

Layout under ``<disk.path>/<namespace.short_id()>/``::

    namespace.json      the namespace fields (for humans and fsck)
    ledger              8-byte used-bytes counter; flock on it serialises publish/delete
    manifest            (key, parent) hint written at close (kvtier/tiers/manifest.py)
    chunks/ab/<key hex>.kvc   published chunks (chunk.py format)
    tmp/<key hex>.<pid>.<thread>.<n>.tmp    files being written

Side-effect free except where a method says it touches the directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvtier.keys import ChunkKey, Namespace
from kvtier.security import PRIVATE_DIR_MODE

SUFFIX = ".kvc"
STALE_TMP_S = 3600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_dead_temp_file(entry: os.DirEntry) -> bool:
    """A temp file ``<name>.<pid>...`` whose writer is another process that is gone, or that is
    older than an hour (or whose name/stat cannot be read)."""
    try:
        pid = int(entry.name.split(".")[1])
        stale = time.time() - entry.stat().st_mtime > STALE_TMP_S
    except (IndexError, ValueError, OSError):
        pid, stale = -1, True
    return pid != os.getpid() and (stale or not _pid_alive(pid))


@dataclass(frozen=True)
class NamespaceDir:
    """Paths of one namespace directory of a disk tier."""

    root: Path
    #: fan-out directories this process made or found (``publish``); not part of the value
    _dirs: set[str] = field(default_factory=set, compare=False, repr=False)
    _chunks_str: str = field(default="", init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_chunks_str", str(self.root / "chunks"))   # path_of, once per put and get

    @property
    def chunks(self) -> Path:
        return self.root / "chunks"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest"

    @property
    def namespace_json(self) -> Path:
        return self.root / "namespace.json"

    @staticmethod
    def all_under(path: Path) -> list["NamespaceDir"]:
        """Every namespace directory of the disk tier at ``path`` (``store.disk.path``)."""
        return [NamespaceDir(p) for p in sorted(path.iterdir()) if (p / "chunks").is_dir()]

    @staticmethod
    def others_under(path: Path, root: Path) -> list[str]:
        """Names of the namespace directories at ``path`` other than ``root`` ([] if unreadable)."""
        try:
            return [d.root.name for d in NamespaceDir.all_under(path) if d.root != root]
        except OSError:
            return []

    def create(self, namespace: Namespace) -> None:
        """Create the directory owner-only (it holds prompts' KV) with its ``chunks/`` and ``tmp/``,
        and ``namespace.json`` when absent (written to a temp file, then renamed into place)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        self.chunks.mkdir(exist_ok=True, mode=PRIVATE_DIR_MODE)
        self.tmp.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        self.make_fanout()
        if not self.namespace_json.exists():
            tmp = self.tmp / f"namespace.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.touch(mode=0o600)
            tmp.write_text(json.dumps({"digest": namespace.digest().hex(),
                                       "namespace": json.loads(namespace.canonical_bytes())}, indent=1))
            os.replace(tmp, self.namespace_json)

    def make_fanout(self) -> None:
        """Make the 256 fan-out directories ``chunks/00`` .. ``chunks/ff`` that are missing (one
        listing, then a ``mkdir`` each), so a put publishes with one rename and never pays a
        directory's creation (a new inode and directory block written back with the chunk)."""
        have = {e.name for e in os.scandir(self.chunks) if e.is_dir()}
        for i in range(256):
            name = f"{i:02x}"
            if name not in have:
                os.makedirs(self.chunks / name, mode=PRIVATE_DIR_MODE, exist_ok=True)
            self._dirs.add(f"{self.chunks}/{name}")

    def path_of(self, key: ChunkKey) -> str:
        h = key.hex()
        return f"{self._chunks_str}/{h[:2]}/{h}{SUFFIX}"

    def publish(self, tmp: str, final: str) -> None:
        """Rename the complete file ``tmp`` to its final name (``os.replace``: atomic, a reader sees
        the name absent or the whole file). The fan-out directory is made at ``create``
        (``make_fanout``), else the first time this process publishes under it (or again when
        the rename finds it removed since), so a publish is one system call, not a ``mkdir``
        failing with EEXIST, a ``stat`` and the rename.
        Raises OSError (FileNotFoundError when ``tmp`` itself is gone)."""
        d = os.path.dirname(final)
        if d not in self._dirs:
            os.makedirs(d, mode=PRIVATE_DIR_MODE, exist_ok=True)
            self._dirs.add(d)
        try:
            os.replace(tmp, final)
        except FileNotFoundError:
            if not os.path.exists(tmp):
                raise
            os.makedirs(d, mode=PRIVATE_DIR_MODE, exist_ok=True)
            os.replace(tmp, final)

    def scan(self) -> dict[ChunkKey, tuple[str, int, float]]:
        """Published chunk files: key -> (path, size, mtime). Reads the directory only."""
        found: dict[ChunkKey, tuple[str, int, float]] = {}
        for sub in os.scandir(self.chunks):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                if not e.name.endswith(SUFFIX) or len(e.name) != 64 + len(SUFFIX):
                    continue
                try:
                    st = e.stat()
                    found[ChunkKey(bytes.fromhex(e.name[:64]))] = (e.path, st.st_size, st.st_mtime)
                except (OSError, ValueError):
                    continue
        return found

    def dead_temp_files(self) -> list[str]:
        """Temp files whose writer is gone (see ``is_dead_temp_file``)."""
        return [e.path for e in os.scandir(self.tmp) if is_dead_temp_file(e)]

    def remove_dead_temp_files(self) -> int:
        """Remove the temp files of dead writers; how many were removed."""
        removed = 0
        for path in self.dead_temp_files():
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        return removed

    def namespace_digest(self) -> bytes | None:
        """The digest recorded in namespace.json (None if absent or unreadable)."""
        try:
            return bytes.fromhex(json.loads(self.namespace_json.read_text())["digest"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


class Ledger:
    """The 8-byte used-bytes counter and the lock that serialises publish/delete across
    processes (flock) and threads (a lock: flock is per open file, not per thread).
    ``Ledger.open(path)`` opens (creates) the file; ``close()`` releases it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._xlock = threading.Lock()

    @classmethod
    def open(cls, path: Path) -> "Ledger":
        return cls(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across threads and processes."""
        with self._xlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self) -> int:
        """Bytes used (0 for an empty/new ledger). Hold ``locked()`` for a consistent value."""
        raw = os.pread(self._fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    def read_raw(self) -> int | None:
        """Like ``read`` but None when the file does not hold 8 bytes (fsck reports it)."""
        raw = os.pread(self._fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def write(self, used: int) -> None:
        os.pwrite(self._fd, max(used, 0).to_bytes(8, "little"), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
