"""Reading the kvtier config out of vLLM's ``kv_connector_extra_config`` (no vLLM import)."""

from __future__ import annotations

from typing import Any

from kvtier.config import ConfigError, KvtierConfig, load_config

EXTRA_KEYS = ("kvtier_config", "kvtier_config_file")


def config_from_extra(extra: dict[str, Any] | None) -> KvtierConfig:
    """The kvtier config named by ``kv_connector_extra_config``: YAML file <- KVTIER_* env <- dict.

    Raises ConfigError (one line) on unknown keys or bad values."""
    extra = extra or {}
    unknown = set(extra) - set(EXTRA_KEYS)
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys for kvtier: {sorted(unknown)}; "
                          f"expected {list(EXTRA_KEYS)}")
    overrides = extra.get("kvtier_config") or {}
    if not isinstance(overrides, dict):
        raise ConfigError("kv_connector_extra_config.kvtier_config must be a mapping")
    return load_config(extra.get("kvtier_config_file"), overrides=overrides)
