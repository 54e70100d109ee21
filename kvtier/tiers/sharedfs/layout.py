"""On-mount layout of the shared-filesystem tier and access stamps.

Layout under ``<sharedfs.path>/<namespace.short_id()>/`` (see docs/store-design.md,
"Shared filesystem tier")::

    namespace.json                  the namespace fields (for humans and fsck)
    chunks/ab/cd/<key hex>.kvc      published chunks, ``dir_levels`` levels of 256 (default 2)
    tmp/<key hex>.<host>.<pid>.<thread>.<n>.tmp    files being written (renamed into chunks/)
    janitor/lease                   the elected janitor's lease (holder, expiry; JSON)
    janitor/usage                   the last pass's totals (bytes, files, time; JSON)

File names are content addresses: two machines writing the same key write the same
bytes, and the last ``rename`` wins harmlessly. A chunk file's **mtime is its access
stamp** (the janitor evicts the oldest first); ``Stamps`` keeps a chain's stamps
non-increasing from head to tail so that order is tail-first.

Side-effect free except ``ensure_root`` (creates the namespace directories).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvtier.keys import ChunkKey, Namespace


SUFFIX = ".kvc"
TIER = "sharedfs"
#: errnos that say "the filesystem/mount is not answering", not "this chunk is absent"
DOWN_ERRNOS = frozenset({errno.ENOTCONN, errno.EIO, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                         errno.ECONNABORTED, errno.ECONNREFUSED, errno.ENODEV, errno.ENXIO})
HOST = socket.gethostname().replace(".", "_") or "host"


class Layout:
    """Paths of one namespace on the mount. Pure: computing a path does no I/O."""

    def __init__(self, base: Path, namespace: Namespace, dir_levels: int) -> None:
        self.base = Path(base)
        self.root = self.base / namespace.short_id()
        self.chunks = self.root / "chunks"
        self.tmp = self.root / "tmp"
        self.janitor = self.root / "janitor"
        self.lease = self.janitor / "lease"
        self.usage = self.janitor / "usage"
        self.levels = dir_levels
        self._chunks_s = str(self.chunks)

    def path_of(self, key: bytes) -> str:
        h = key.hex()
        parts = [h[2 * i:2 * i + 2] for i in range(self.levels)]
        return f"{self._chunks_s}/{'/'.join(parts)}/{h}{SUFFIX}"

    def key_of(self, name: str) -> ChunkKey | None:
        """The key a chunk file name encodes, or None for anything else (temp files, strays)."""
        if len(name) != 64 + len(SUFFIX) or not name.endswith(SUFFIX):
            return None
        try:
            return ChunkKey(bytes.fromhex(name[:64]))
        except ValueError:
            return None

    def ensure_root(self, namespace: Namespace) -> None:
        """Create the namespace directories (not ``base``: a missing base means a missing mount)
        and ``namespace.json`` (temp + rename). Raises OSError (EROFS, ENOENT, ...)."""
        if not self.base.is_dir():
            raise FileNotFoundError(errno.ENOENT, "shared directory is missing (is the filesystem mounted?)",
                                    str(self.base))
        for d in (self.root, self.chunks, self.tmp, self.janitor):
            d.mkdir(exist_ok=True)
        ns_file = self.root / "namespace.json"
        if not ns_file.exists():
            tmp = self.tmp / f"namespace.{HOST}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps({"digest": namespace.digest().hex(),
                                       "namespace": json.loads(namespace.canonical_bytes())}, indent=1))
            os.replace(tmp, ns_file)

    def read_json(self, path: Path) -> dict | None:
        """A small JSON file's mapping, or None when absent / half-written / unreadable."""
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_json(self, path: Path, data: dict) -> None:
        """Atomically replace ``path`` (temp file in tmp/ + rename). Raises OSError."""
        tmp = self.tmp / f"{path.name}.{HOST}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


class Stamps:
    """Access stamps (mtime, ns) this process assigned or saw, bounded LRU.

    Invariant kept by the tier: along a chain, a child's stamp is <= its parent's, so the
    janitor's oldest-first order removes chain tails first. A write stamps a chunk just below
    its parent's known stamp; a read that refreshes stamps gives the head the newest one."""

    STEP_NS = 1000      # 1 us between neighbours of one chain

    def __init__(self, capacity: int = 65536) -> None:
        self._d: OrderedDict[bytes, int] = OrderedDict()
        self._cap = capacity
        self._lock = threading.Lock()

    def get(self, key: bytes) -> int | None:
        with self._lock:
            return self._d.get(key)

    def set(self, key: bytes, stamp: int) -> None:
        with self._lock:
            self._d[key] = stamp
            self._d.move_to_end(key)
            while len(self._d) > self._cap:
                self._d.popitem(last=False)

    def drop(self, key: bytes) -> None:
        with self._lock:
            self._d.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def for_write(self, parent: bytes | None, now_ns: int) -> int:
        """Stamp for a new chunk: just below its parent's (if this process knows it), else now."""
        p = self.get(parent) if parent is not None else None
        return now_ns if p is None else min(now_ns, p - self.STEP_NS)


__all__ = ["DOWN_ERRNOS", "HOST", "Layout", "Stamps", "SUFFIX", "TIER"]
