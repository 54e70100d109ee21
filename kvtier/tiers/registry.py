"""Tier factory: builds the configured tiers, top (fastest) first.

A new backend (e.g. a shared remote store) adds a builder here; the store only sees
the ``Tier`` interface. Builders return None when their section is disabled.
"""

from __future__ import annotations

from typing import Callable

from kvtier.config import StoreConfig
from kvtier.keys import Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier

TierBuilder = Callable[[StoreConfig, Namespace, Telemetry], Tier | None]


def build_memory(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> MemoryTier | None:
    m = config.memory
    if not m.enabled or m.capacity <= 0:
        return None
    return MemoryTier.open(m.capacity, slot_size=m.slot_size, policy=config.eviction, prefault=m.prefault,
                           telemetry=telemetry)


def build_disk(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> DiskTier | None:
    d = config.disk
    if not d.enabled or d.path is None:
        return None
    try:
        return DiskTier.open(d.path, namespace, d.capacity, fsync=d.fsync, o_direct=d.o_direct,
                             policy=config.eviction, writer_threads=d.writer_threads, queue_depth=d.queue_depth,
                             rescan_interval_s=d.rescan_interval_s, telemetry=telemetry)
    except OSError as e:   # read-only mount, permission denied, not a directory, full at open: no SSD tier
        telemetry.event("tier_unavailable", "disk", f"cannot open store.disk.path {d.path}: {e.strerror or e}; "
                        "serving without the SSD tier")
        return None


TIER_BUILDERS: dict[str, TierBuilder] = {"memory": build_memory, "disk": build_disk}


def open_tiers(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> dict[str, Tier]:
    """Open every enabled tier, in order (memory, disk, ...)."""
    tiers: dict[str, Tier] = {}
    for name, build in TIER_BUILDERS.items():
        tier = build(config, namespace, telemetry)
        if tier is not None:
            tiers[name] = tier
    wrapped = wrap_faults(config, namespace, telemetry, list(tiers.values()))
    return {t.name: t for t in wrapped}


def wrap_faults(config: StoreConfig, namespace: Namespace, telemetry: Telemetry, tiers: list[Tier]) -> list[Tier]:
    """``store.faults`` (a drill): the tier it names (``memory``, ``disk``, or the ``shared`` one)
    wrapped in ``kvtier.tiers.faulty.FaultyTier``; the list unchanged without ``store.faults``."""
    f = config.faults
    if f is None:
        return tiers
    from kvtier.tiers.faulty import FaultyTier   # lazy: only drills import it

    def named(t: Tier) -> bool:
        return t.capabilities.shared if f.wraps == "shared" else t.name == f.wraps
    return [FaultyTier.wrap(t, f, namespace, telemetry) if named(t) else t for t in tiers]
