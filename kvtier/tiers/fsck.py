"""Offline/online check of a disk-tier directory (``kvtier fsck DIR``), diskcache-style.

For every namespace sub-directory: fully verify every chunk file (header, namespace,
key = file name, length, checksum), find orphans (a chunk whose parent chunk file is
absent, transitively), find temp files of dead writers, and with ``repair`` remove
all of those and reset the ledger from what is left. Safe to run while stores use
the directory: removals and the ledger reset take the same lock as publishing.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.chunk import ChunkError, decode
from kvtier.keys import ChunkKey
from kvtier.tiers.disk import SUFFIX, is_dead_temp_file


@dataclass
class CheckReport:
    namespaces: int = 0
    chunks: int = 0
    ok: int = 0
    bytes_ok: int = 0
    bad: dict[str, str] = field(default_factory=dict)          # path -> event kind
    orphans: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    removed: int = 0
    ledger_fixed: int = 0                                      # namespaces whose ledger was wrong

    @property
    def clean(self) -> bool:
        return not (self.bad or self.orphans or self.temp_files)


def _chunk_files(chunks: Path) -> dict[ChunkKey, str]:
    out: dict[ChunkKey, str] = {}
    for sub in os.scandir(chunks):
        if sub.is_dir():
            for e in os.scandir(sub.path):
                if e.name.endswith(SUFFIX) and len(e.name) == 64 + len(SUFFIX):
                    try:
                        out[ChunkKey(bytes.fromhex(e.name[:64]))] = e.path
                    except ValueError:
                        continue
    return out


def check(path: str | Path, *, repair: bool = True) -> CheckReport:
    """Verify a disk-tier directory (the ``store.disk.path``); see the module docstring."""
    report = CheckReport()
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    for nsdir in sorted(p for p in root.iterdir() if (p / "chunks").is_dir()):
        report.namespaces += 1
        _check_namespace(nsdir, report, repair)
    return report


def _check_namespace(nsdir: Path, report: CheckReport, repair: bool) -> None:
    try:
        ns_digest: bytes | None = bytes.fromhex(json.loads((nsdir / "namespace.json").read_text())["digest"])
    except (OSError, ValueError, KeyError):
        ns_digest = None
    for e in os.scandir(nsdir / "tmp"):
        if is_dead_temp_file(e):
            report.temp_files.append(e.path)
    files = _chunk_files(nsdir / "chunks")
    report.chunks += len(files)
    parents: dict[ChunkKey, ChunkKey | None] = {}
    sizes: dict[ChunkKey, int] = {}
    for key, p in files.items():
        try:
            with open(p, "rb") as f:
                data = f.read()
            meta, _ = decode(ns_digest, data, expect_key=key)
        except ChunkError as err:
            report.bad[p] = err.kind
            continue
        except OSError:
            continue                       # vanished meanwhile (evicted by a live store)
        parents[key] = meta.parent
        sizes[key] = len(data)
    orphan: set[ChunkKey] = set()
    changed = True
    while changed:                         # an orphan's children are orphans too
        changed = False
        for key, parent in parents.items():
            if key not in orphan and parent is not None and (parent not in parents or parent in orphan):
                orphan.add(key)
                changed = True
    report.orphans.extend(files[k] for k in orphan)
    report.ok += len(parents) - len(orphan)
    report.bytes_ok += sum(sizes[k] for k in parents if k not in orphan)
    if repair:
        _repair(nsdir, report, [*report.temp_files, *report.bad, *(files[k] for k in orphan)])


def _repair(nsdir: Path, report: CheckReport, doomed: list[str]) -> None:
    fd = os.open(nsdir / "ledger", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for p in doomed:
            try:
                os.unlink(p)
                report.removed += 1
            except FileNotFoundError:
                pass
        total = 0
        for p in _chunk_files(nsdir / "chunks").values():
            try:
                total += os.stat(p).st_size
            except FileNotFoundError:
                pass
        raw = os.pread(fd, 8, 0)
        if (int.from_bytes(raw, "little") if len(raw) == 8 else -1) != total:
            report.ledger_fixed += 1
            os.pwrite(fd, total.to_bytes(8, "little"), 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
