"""Typed config: YAML + KVTIER_* env + overrides, one-line errors naming the field."""

from __future__ import annotations

import pytest

from kvtier.config import ConfigError, load_config, parse_size


@pytest.mark.parametrize("text,expected", [("512MiB", 512 * 2**20), ("4GB", 4 * 10**9), ("1.5GiB", int(1.5 * 2**30)),
                                           (1024, 1024), ("2048", 2048), ("1 kib", 1024)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "1XB", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_precedence_yaml_env_overrides(tmp_path):
    f = tmp_path / "kvtier.yaml"
    f.write_text("store:\n  chunk_size: 512\n  memory:\n    capacity: 1GiB\n  disk:\n    enabled: true\n"
                 f"    path: {tmp_path}/ssd\n")
    cfg = load_config(f, env={"KVTIER_STORE__MEMORY__CAPACITY": "2GiB"}, overrides={"store": {"eviction": "cost"}})
    assert cfg.store.chunk_size == 512
    assert cfg.store.memory.capacity == 2 * 2**30
    assert cfg.store.disk.enabled and str(cfg.store.disk.path) == f"{tmp_path}/ssd"
    assert cfg.store.eviction == "cost"


@pytest.mark.parametrize("env,needle", [
    ({"KVTIER_STORE__MEMORY__CAPACITY": "lots"}, "store.memory.capacity"),
    ({"KVTIER_STORE__DISK__ENABLED": "true"}, "store.disk.path"),
    ({"KVTIER_STORE__NOPE": "1"}, "store.nope"),
    ({"KVTIER_STORE__EVICTION": "mru"}, "store.eviction"),
    ({"KVTIER_STORE__CHUNK_SIZE": "0"}, "store.chunk_size"),
])
def test_bad_values_give_one_line_naming_the_field(env, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(env=env)
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("store: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar, env={})


def test_unrelated_kvtier_env_is_ignored():
    cfg = load_config(env={"KVTIER_HOME": "/x", "KVTIER_MODEL_DIR": "/y"})
    assert cfg.store.chunk_size == 256
