"""kvtier's SSD and shared tiers as a secondary tier of vLLM's native KV offloading.

In vLLM's ``kv_connector_extra_config`` (``OffloadingConnector``, ``spec_name: TieringOffloadingSpec``)::

    "secondary_tiers": [{"type": "KvtierSecondaryTier",
                         "module_path": "kvtier.integrations.vllm_tiering",
                         "kvtier_config_file": "/etc/kvtier/tier.yaml"}]

See docs/vllm-tiering.md. Importing this package imports vLLM.
"""

from kvtier.integrations.vllm_tiering.manager import KvtierSecondaryTier

__all__ = ["KvtierSecondaryTier"]
