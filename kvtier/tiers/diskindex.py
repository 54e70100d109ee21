"""One process's index of the chunk files in a disk tier's namespace directory.

Per published chunk: its file size, its parent (known from a write, a read or the manifest; or
not yet, when a directory scan found the file and its header could not be read), and its place
in the eviction order. ``merge_scan`` brings the index in line with a directory scan: keys whose
files are gone leave it, new files join it, their parents taken from the manifest hints or read
from their headers. Thread-safe: every method takes ``lock`` (re-entrant), membership and size
look-ups are plain dict reads.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from kvtier.eviction import EvictionPolicy, PolicyName
from kvtier.keys import ChunkKey
from kvtier.tiers import diskio, manifest
from kvtier.tiers.disklayout import NamespaceDir


class DiskIndex:
    """The index of ``layout``'s chunk files, evicting in ``policy`` order."""

    def __init__(self, layout: NamespaceDir, policy: PolicyName) -> None:
        self.layout = layout
        self.lock = threading.RLock()
        self._sizes: dict[ChunkKey, int] = {}   # key -> file size
        self._unknown_parent: set[ChunkKey] = set()
        self._policy = EvictionPolicy(policy)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size(self, key: ChunkKey) -> int | None:
        """The chunk file's size in bytes, or None when not indexed."""
        return self._sizes.get(key)

    def add(self, key: ChunkKey, size: int, parent: ChunkKey | None, parent_known: bool, tokens: int = 1) -> None:
        """Index ``key`` (or touch it, learning its parent if that was unknown)."""
        with self.lock:
            if key in self._sizes:
                if parent_known and key in self._unknown_parent:
                    self._unknown_parent.discard(key)
                    self._policy.set_parent(key, parent)
                self._policy.touch(key)
                return
            self._sizes[key] = size
            self._policy.add(key, parent if parent_known else None, size, tokens)
            if not parent_known:
                self._unknown_parent.add(key)

    def drop(self, key: ChunkKey) -> None:
        with self.lock:
            if self._sizes.pop(key, None) is not None:
                self._policy.remove(key)
                self._unknown_parent.discard(key)

    def scan(self) -> dict[ChunkKey, tuple[int, float]]:
        """Published chunk files now in the directory: key -> (size, mtime)."""
        return {k: (size, mtime) for k, (_, size, mtime) in self.layout.scan().items()}

    def keys(self) -> list[ChunkKey]:
        with self.lock:
            return list(self._sizes)

    def parent(self, key: ChunkKey) -> ChunkKey | None:
        with self.lock:
            return self._policy.parent(key)

    def has_children(self, key: ChunkKey) -> bool:
        return self._policy.has_children(key)

    def children(self, key: ChunkKey) -> set[ChunkKey]:
        with self.lock:
            return set(self._policy.children(key))

    def orphans(self, present: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        with self.lock:
            return self._policy.orphans(present)

    def pick_victim(self, exclude: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """The next chunk to evict, skipping those ``exclude`` keeps; None when none is left."""
        with self.lock:
            return self._policy.pick(exclude=exclude)

    def manifest_records(self) -> list[tuple[ChunkKey, ChunkKey | None]]:
        """(key, parent) of every indexed chunk whose parent is known."""
        with self.lock:
            return [(k, self._policy.parent(k)) for k in self._sizes if k not in self._unknown_parent]

    def merge_scan(self, found: dict[ChunkKey, tuple[int, float]], before: set[ChunkKey] | None) -> list[ChunkKey]:
        """Index what ``found`` (key -> (size, mtime)) has and drop what it lacks; returns the keys dropped.

        ``before``: only keys indexed before the scan started may be dropped (a chunk published
        while an unlocked scan ran is not in ``found`` yet); None = drop every key not found."""
        with self.lock:
            gone = [k for k in self._sizes if k not in found and (before is None or k in before)]
        if before is not None:   # an unlocked scan may have missed a file being replaced: confirm
            gone = [k for k in gone if not os.path.exists(self.layout.path_of(k))]
        for key in gone:
            self.drop(key)
        with self.lock:
            new = sorted((k for k in found if k not in self._sizes or k in self._unknown_parent),
                         key=lambda k: found[k][1])
        hints = manifest.load(self.layout.manifest) if new else {}
        for key in new:   # serial raw reads beat a thread pool here (GIL + per-task overhead)
            if key in hints:
                parent, known, tokens = hints[key], True, 1
            else:
                head = diskio.read_header(self.layout.path_of(key))
                parent, known, tokens = (head.parent, True, head.num_tokens) if head else (None, False, 1)
            self.add(key, found[key][0], parent, known, tokens)
        return gone
