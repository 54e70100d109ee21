"""kv_connector_extra_config -> KvtierConfig (dict, YAML file, env)."""

from __future__ import annotations

import pytest

from kvtier.config import ConfigError
from kvtier.integrations.vllm.extra_config import config_from_extra


def test_dict_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "k.yaml"
    f.write_text("store:\n  chunk_size: 512\n  memory:\n    capacity: 1GiB\n")
    monkeypatch.setenv("KVTIER_STORE__MEMORY__CAPACITY", "3GiB")
    cfg = config_from_extra({"kvtier_config_file": str(f), "kvtier_config": {"connector": {"min_hit_chunks": 2}}})
    assert cfg.store.chunk_size == 512 and cfg.store.memory.capacity == 3 * 2**30
    assert cfg.connector.min_hit_chunks == 2
    cfg = config_from_extra({"kvtier_config": {"store": {"memory": {"capacity": "1GiB"}}}})
    assert cfg.store.memory.capacity == 2**30          # the dict wins over the environment
    assert config_from_extra(None).store.chunk_size == 256


def test_bad_extra_config_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys"):
        config_from_extra({"shared_storage_path": "/tmp"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        config_from_extra({"kvtier_config": "store.chunk_size=1"})
    with pytest.raises(ConfigError, match="not found"):
        config_from_extra({"kvtier_config_file": str(tmp_path / "missing.yaml")})
    with pytest.raises(ConfigError, match="chunk_size"):
        config_from_extra({"kvtier_config": {"store": {"chunk_size": 0}}})
