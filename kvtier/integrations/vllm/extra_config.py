"""Reading the kvtier config out of vLLM's ``kv_connector_extra_config`` (no vLLM import)."""

from __future__ import annotations

from typing import Any, Mapping

from kvtier.config import ConfigError, KvtierConfig, config_file, load_config

EXTRA_KEYS = ("kvtier_config", "kvtier_config_file")


def config_from_extra(extra: dict[str, Any] | None, env: Mapping[str, str] | None = None) -> KvtierConfig:
    """The kvtier config named by ``kv_connector_extra_config``: YAML file <- KVTIER_* env <- dict.

    The YAML file is ``kvtier_config_file``; when the extra config names neither ``kvtier_config_file``
    nor ``kvtier_config``, it is ``$KVTIER_CONFIG_FILE`` (if set), as LMCache reads
    ``LMCACHE_CONFIG_FILE``. ``env`` defaults to the process environment.
    Raises ConfigError (one line) on unknown keys or bad values."""
    extra = extra or {}
    unknown = set(extra) - set(EXTRA_KEYS)
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys for kvtier: {sorted(unknown)}; "
                          f"expected {list(EXTRA_KEYS)}")
    overrides = extra.get("kvtier_config") or {}
    if not isinstance(overrides, dict):
        raise ConfigError("kv_connector_extra_config.kvtier_config must be a mapping")
    path = extra.get("kvtier_config_file")
    if path is None and "kvtier_config" not in extra:
        path = config_file(None, env)
    return load_config(path, env=env, overrides=overrides)
