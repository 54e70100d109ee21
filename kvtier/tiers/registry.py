"""Tier factory: builds the configured tiers as one ordered list, top (fastest) first.

    memory (store.memory)  ->  disk (store.disk)  ->  shared (store.shared, at most one)

Local tiers are built here. Shared backends are named by ``store.shared.kind`` and
mapped to ``"module:Class"`` strings that are imported **only when configured**, so a
missing client library is an error only for whoever configures that backend (a
one-line ``ConfigError`` naming the backend and the pip package). A shared backend
class is constructed by ``Class.open(cfg, namespace, telemetry)``; every tier whose
``capabilities.shared`` is True is wrapped in ``GuardedTier`` (bounded threads,
deadlines, circuit breaker). Side-effect free until ``open_tiers`` is called.
"""

from __future__ import annotations

import importlib
from typing import Callable

from kvtier.config import ConfigError, SharedTierBase, StoreConfig
from kvtier.keys import Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier

TierBuilder = Callable[[StoreConfig, Namespace, Telemetry], Tier | None]

#: kind -> ("module:Class", pip package that provides its client library, or None if none is needed)
SHARED_BACKENDS: dict[str, tuple[str, str | None]] = {
    "sharedfs": ("kvtier.tiers.sharedfs:SharedFsTier", None),
    "valkey": ("kvtier.tiers.valkey:ValkeyTier", "valkey"),
    "mooncake": ("kvtier.tiers.mooncake:MooncakeTier", "mooncake-transfer-engine-non-cuda"),
}
#: ``store.faults`` (a drill) wraps one tier in this class, imported only when configured
FAULTS_BACKEND = "kvtier.tiers.faulty:FaultyTier"


def build_memory(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> Tier | None:
    from kvtier.tiers.memory import MemoryTier

    m = config.memory
    if not m.enabled or m.capacity <= 0:
        return None
    return MemoryTier.open(m.capacity, slot_size=m.slot_size, policy=config.eviction, prefault=m.prefault,
                           telemetry=telemetry)


def build_disk(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> Tier | None:
    from kvtier.tiers.disk import DiskTier

    d = config.disk
    if not d.enabled or d.path is None:
        return None
    from kvtier.metrics import log
    from kvtier.security import UnsafeDirectory, check_private_dir

    try:
        check_private_dir(d.path, allow_shared=d.allow_shared_dir)
        return DiskTier.open(d.path, namespace, d.capacity, fsync=d.fsync, o_direct=d.o_direct,
                             policy=config.eviction, writer_threads=d.writer_threads, queue_depth=d.queue_depth,
                             rescan_interval_s=d.rescan_interval_s, telemetry=telemetry)
    except UnsafeDirectory as e:     # other local users could read prompts' KV or plant chunks: no SSD tier
        log.error("kvtier: SSD tier disabled: %s", e)
        telemetry.event("unsafe_dir", "disk", str(e))
        return None
    except OSError as e:   # read-only mount, permission denied, not a directory, full at open: no SSD tier
        telemetry.event("tier_unavailable", "disk", f"cannot open store.disk.path {d.path}: {e.strerror or e}; "
                        "serving without the SSD tier")
        return None


def backend_class(kind: str) -> type:
    """Import the class of shared backend ``kind``; ConfigError (one line) if it cannot be."""
    spec = SHARED_BACKENDS.get(kind)
    if spec is None:
        raise ConfigError(f"store.shared.kind: unknown backend {kind!r}; known: {sorted(SHARED_BACKENDS)}")
    target, pip_name = spec
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        if missing == module_name or missing.startswith("kvtier"):
            raise ConfigError(f"store.shared.kind={kind!r}: this kvtier build has no {module_name}") from None
        hint = f"; install it with: pip install {pip_name}" if pip_name else ""
        raise ConfigError(f"store.shared.kind={kind!r} needs the Python package {missing!r}, which is not "
                          f"installed{hint}") from None
    try:
        return getattr(module, cls_name)
    except AttributeError:
        raise ConfigError(f"store.shared.kind={kind!r}: {module_name} has no {cls_name}") from None


def build_shared(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> Tier | None:
    cfg = config.shared
    if cfg is None:
        return None
    tier = open_shared_backend(cfg, namespace, telemetry)
    if config.faults is not None and config.faults.wraps == "shared":
        tier = _faulty(config, namespace, telemetry, tier)      # inside the guard, like a real stall
    return guard_if_shared(tier, cfg, telemetry)


def open_shared_backend(cfg: SharedTierBase, namespace: Namespace, telemetry: Telemetry) -> Tier:
    """The backend of ``cfg``, storing payloads in ``cfg.encoding`` (``kvtier.tiers.encoded``: its
    own namespace, decoded on read) unless that is ``plain``."""
    if cfg.encoding == "plain":
        return backend_class(cfg.kind).open(cfg, namespace, telemetry)
    from kvtier.tiers.encoded import EncodedTier, encoded_namespace

    try:
        from kvtier.encoding import require_codec

        require_codec(cfg.encoding)
    except ImportError as e:
        raise ConfigError(str(e)) from None
    inner = backend_class(cfg.kind).open(cfg, encoded_namespace(namespace, cfg.encoding), telemetry)
    return EncodedTier.wrap(inner, cfg.encoding, telemetry)


def _faulty(config: StoreConfig, namespace: Namespace, telemetry: Telemetry, tier: Tier) -> Tier:
    from kvtier.tiers.faulty import FaultyTier   # lazy: only drills import it

    assert config.faults is not None
    return FaultyTier.wrap(tier, config.faults, namespace, telemetry)


def guard_if_shared(tier: Tier, cfg: SharedTierBase, telemetry: Telemetry) -> Tier:
    """``tier`` behind ``GuardedTier`` when its capabilities say it is shared, else ``tier``."""
    if not tier.capabilities.shared:
        return tier
    from kvtier.tiers.guard import GuardedTier

    return GuardedTier.wrap(tier, cfg, telemetry)


TIER_BUILDERS: dict[str, TierBuilder] = {"memory": build_memory, "disk": build_disk, "shared": build_shared}


def open_tiers(config: StoreConfig, namespace: Namespace, telemetry: Telemetry) -> list[Tier]:
    """Open every enabled tier, in order (memory, disk, shared). On an error, tiers already
    opened are closed before it propagates."""
    tiers: list[Tier] = []
    try:
        for name, build in TIER_BUILDERS.items():
            tier = build(config, namespace, telemetry)
            if tier is None:
                continue
            if config.faults is not None and config.faults.wraps == name != "shared":
                tier = _faulty(config, namespace, telemetry, tier)   # ``store.faults``: a drill
            tiers.append(tier)
    except BaseException:
        for t in reversed(tiers):
            t.close()
        raise
    return tiers
