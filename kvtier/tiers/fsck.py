"""Offline/online check of a disk-tier directory (``kvtier fsck DIR``), diskcache-style.

Uses the disk tier's own layout, ledger lock and manifest code (``kvtier.tiers.disklayout``,
``kvtier.tiers.manifest``). For every namespace sub-directory:

* fully verify every chunk file (header, namespace, key = file name, length, checksum);
* find orphans (a chunk whose parent chunk file is absent or bad, transitively);
* find temp files of dead writers (a crashed writer's ``tmp/`` leftovers);
* check the ledger against the bytes on disk, and the bytes on disk against the budget
  (``capacity``, the configured ``store.disk.capacity``);
* check the manifest hint: damaged, or naming chunks that are gone or with another parent.

With ``repair``: remove (or, with ``quarantine``, move into that directory, keeping the
``<namespace>/chunks/ab/<key>.kvc`` layout) the bad chunks, orphans and dead temp files,
reset the ledger from what is left and rewrite a stale manifest. Safe to run while stores
use the directory: removals and the ledger reset take the same lock as publishing.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.chunk import ChunkError, decode
from kvtier.keys import ChunkKey
from kvtier.tiers import manifest
from kvtier.tiers.disklayout import Ledger, NamespaceDir


@dataclass
class NamespaceUsage:
    namespace: str
    bytes_on_disk: int
    ledger: int | None          # None: the ledger file is missing or not 8 bytes
    capacity: int | None
    chunks: int

    @property
    def over_budget(self) -> bool:
        return self.capacity is not None and self.bytes_on_disk > self.capacity


@dataclass
class CheckReport:
    namespaces: int = 0
    chunks: int = 0
    ok: int = 0
    bytes_ok: int = 0
    bad: dict[str, str] = field(default_factory=dict)          # path -> event kind
    orphans: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    stale_manifests: dict[str, str] = field(default_factory=dict)   # manifest path -> why
    ledger_wrong: list[str] = field(default_factory=list)      # namespace dirs whose ledger != bytes on disk
    usage: list[NamespaceUsage] = field(default_factory=list)
    removed: int = 0
    quarantined: int = 0
    ledger_fixed: int = 0                                      # namespaces whose ledger was reset
    manifests_rewritten: int = 0

    @property
    def over_budget(self) -> list[str]:
        return [u.namespace for u in self.usage if u.over_budget]

    @property
    def clean(self) -> bool:
        return not (self.bad or self.orphans or self.temp_files or self.stale_manifests or self.ledger_wrong
                    or self.over_budget)

    def to_dict(self) -> dict:
        d = asdict(self)
        for u, du in zip(self.usage, d["usage"]):
            du["over_budget"] = u.over_budget
        return {**d, "over_budget": self.over_budget, "clean": self.clean}


def check(path: str | Path, *, repair: bool = True, quarantine: str | Path | None = None,
          capacity: int | None = None) -> CheckReport:
    """Verify a disk-tier directory (the ``store.disk.path``); see the module docstring."""
    report = CheckReport()
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    qdir = Path(quarantine) if quarantine is not None else None
    for nsdir in NamespaceDir.all_under(root):
        report.namespaces += 1
        _check_namespace(nsdir, report, repair, qdir, capacity)
    return report


def _check_namespace(nsdir: NamespaceDir, report: CheckReport, repair: bool, qdir: Path | None,
                     capacity: int | None) -> None:
    ns_digest = nsdir.namespace_digest()
    temp_files = nsdir.dead_temp_files() if nsdir.tmp.is_dir() else []
    report.temp_files.extend(temp_files)
    files = {k: p for k, (p, _, _) in nsdir.scan().items()}
    report.chunks += len(files)
    parents: dict[ChunkKey, ChunkKey | None] = {}
    sizes: dict[ChunkKey, int] = {}
    bad: list[str] = []
    for key, p in files.items():
        try:
            with open(p, "rb") as f:
                data = f.read()
            meta, _ = decode(ns_digest, data, expect_key=key)
        except ChunkError as err:
            report.bad[p] = err.kind
            bad.append(p)
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
    good = {k: parents[k] for k in parents if k not in orphan}
    report.ok += len(good)
    report.bytes_ok += sum(sizes[k] for k in good)
    stale = _manifest_problem(nsdir, good)
    if stale is not None:
        report.stale_manifests[str(nsdir.manifest)] = stale
    ledger = Ledger.open(nsdir.ledger)
    try:
        with ledger.locked():
            recorded = ledger.read_raw()
            on_disk = sum(size for _, size, _ in nsdir.scan().values())
            if recorded != on_disk:
                report.ledger_wrong.append(str(nsdir.root))
            if repair:
                for p in [*temp_files, *bad, *(files[k] for k in orphan)]:
                    if _dispose(p, nsdir, qdir):
                        if qdir is None:
                            report.removed += 1
                        else:
                            report.quarantined += 1
                left = sum(size for _, size, _ in nsdir.scan().values())
                if recorded != left:
                    ledger.write(left)
                    report.ledger_fixed += 1
                if stale is not None:
                    tmp = f"{nsdir.tmp}/manifest.fsck.{os.getpid()}.tmp"
                    try:
                        manifest.save(nsdir.manifest, tmp, good.items())
                        report.manifests_rewritten += 1
                    except OSError:
                        pass
    finally:
        ledger.close()
    report.usage.append(NamespaceUsage(nsdir.root.name, on_disk, recorded, capacity, len(files)))


def _manifest_problem(nsdir: NamespaceDir, good: dict[ChunkKey, ChunkKey | None]) -> str | None:
    """Why the manifest hint is stale (None: absent, or consistent with the verified chunks)."""
    try:
        size = nsdir.manifest.stat().st_size
    except FileNotFoundError:
        return None
    entries = manifest.load(nsdir.manifest)
    if not entries and size != 16:        # 16 bytes = a valid manifest of zero records
        return "damaged (checksum or length)"
    gone = sum(1 for k in entries if k not in good)
    wrong = sum(1 for k, p in entries.items() if k in good and good[k] != p)
    if gone or wrong:
        return f"{gone} entries without a valid chunk, {wrong} with another parent"
    return None


def _dispose(path: str, nsdir: NamespaceDir, qdir: Path | None) -> bool:
    """Remove ``path`` or move it under ``qdir/<namespace>/...``; False if it vanished meanwhile."""
    try:
        if qdir is None:
            os.unlink(path)
        else:
            dest = qdir / nsdir.root.name / Path(path).relative_to(nsdir.root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, dest)
        return True
    except FileNotFoundError:
        return False
