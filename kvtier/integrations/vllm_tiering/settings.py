"""The tier's settings from its entry in vLLM's ``secondary_tiers`` list (no vLLM import).

vLLM passes every field of the entry except ``type``, ``module_path`` and ``backpressure`` to the
tier's constructor; the kvtier fields are read here into one typed ``TierSettings``:

    kvtier_config_file   kvtier's YAML (as the connector's ``kvtier_config_file``); when neither it
                         nor ``kvtier_config`` is given, ``$KVTIER_CONFIG_FILE``
    kvtier_config        overrides over the file (a mapping, as the connector's ``kvtier_config``)
    enable_kv_events     report this tier's stores and evictions as KV events (as vLLM's ``fs`` tier)
    locality             LOCAL or REMOTE, as vLLM's tiers take it
    job_threads          threads running this tier's store and load jobs

kvtier's store under vLLM's offloading is the part below RAM: vLLM's primary tier is the RAM, so
``store.memory`` is switched off here, and ``store.chunk_size`` is the primary tier's chunk (set from
the offloading config, whatever the file says). At least one of ``store.disk`` and ``store.shared``
must be on. Every problem is a ``ConfigError`` with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvtier.config import ConfigError, KvtierConfig, MemoryTierConfig, StoreConfig
from kvtier.integrations.vllm.extra_config import config_from_extra

LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True)
class TierSettings:
    """What the tier was configured with: kvtier's config and the vLLM-facing switches."""

    kvtier: KvtierConfig
    enable_kv_events: bool = False
    locality: str | None = None
    job_threads: int = 4

    @classmethod
    def from_entry(cls, kvtier_config_file: str | None, kvtier_config: Mapping[str, Any] | None,
                   enable_kv_events: bool, locality: str | None, job_threads: int,
                   env: Mapping[str, str] | None = None) -> "TierSettings":
        """Settings from the fields of one ``secondary_tiers`` entry. Raises ConfigError."""
        extra: dict[str, Any] = {}
        if kvtier_config_file is not None:
            extra["kvtier_config_file"] = str(kvtier_config_file)
        if kvtier_config is not None:
            if not isinstance(kvtier_config, Mapping):
                raise ConfigError("secondary tier kvtier_config must be a mapping of kvtier config fields")
            extra["kvtier_config"] = dict(kvtier_config)
        if locality is not None and str(locality).upper() not in LOCALITIES:
            raise ConfigError(f"secondary tier locality must be one of {list(LOCALITIES)}, got {locality!r}")
        if not isinstance(job_threads, int) or isinstance(job_threads, bool) or not 1 <= job_threads <= 64:
            raise ConfigError(f"secondary tier job_threads must be an integer in [1, 64], got {job_threads!r}")
        cfg = config_from_extra(extra, env)
        store = cfg.store
        if not store.disk.enabled and store.shared is None:
            raise ConfigError("kvtier under vLLM's offloading needs store.disk (enabled with a path) or "
                              "store.shared: vLLM's primary tier is the RAM, kvtier serves the tiers below it")
        return cls(kvtier=cfg, enable_kv_events=bool(enable_kv_events),
                   locality=None if locality is None else str(locality).upper(), job_threads=job_threads)

    def store_config(self, chunk_tokens: int) -> StoreConfig:
        """kvtier's store config under vLLM's primary tier: no RAM tier, chunks of ``chunk_tokens``."""
        return self.kvtier.store.model_copy(update={"memory": MemoryTierConfig(enabled=False),
                                                    "chunk_size": chunk_tokens})

    @property
    def load_timeout_s(self) -> float:
        """Deadline of one load job (``connector.load_timeout_s``; a shared tier's reads are also
        capped by its ``io_timeout_s``)."""
        return self.kvtier.connector.load_timeout_s

    @property
    def lookup_timeout_s(self) -> float:
        """Deadline of one batched existence check on the shared tier."""
        shared = self.kvtier.store.shared
        return shared.lookup_timeout_s if shared is not None else 0.0
