"""Local-host security: private cache directories, secrets never on a command line, loopback listeners."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.config import KvtierConfig, StoreConfig, load_config
from kvtier.security import UnsafeDirectory, check_private_dir, is_loopback, split_secrets

SECRET = "s3cret-deployment-key-0123456789"


def test_new_cache_directory_is_owner_only(tmp_path):
    d = tmp_path / "a" / "b"
    check_private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_world_writable_cache_directory_is_refused_unless_allowed(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        check_private_dir(d)
    check_private_dir(d, allow_shared=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_cache_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(UnsafeDirectory, match="owned by uid 65534"):
        check_private_dir(d)


def test_split_secrets_moves_every_secret_to_the_environment():
    cfg = load_config(overrides={"store": {"signing_key": SECRET}}, env={})
    public, env = split_secrets(cfg)
    assert SECRET not in repr(public)
    assert env == {"KVTIER_STORE__SIGNING_KEY": SECRET}
    # the other process rebuilds the same config from the public part + its environment
    again = load_config(overrides=public, env=env)
    assert again.store.signing_key.get_secret_value() == SECRET
    assert again == cfg


def test_kvtier_serve_never_puts_secrets_on_the_command_line(tmp_path):
    from kvtier.cli import _register_all, app

    if not any(c.name == "serve" for c in app.registered_commands):
        _register_all()
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"store:\n  signing_key: {SECRET}\n")
    res = CliRunner().invoke(app, ["serve", "--config", str(cfg), "--model", str(tmp_path), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "vllm.entrypoints.openai.api_server" in res.output
    assert SECRET not in res.output


def _listen_addr(port: int) -> str | None:
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                return addr
    return None


def test_metrics_endpoint_binds_loopback_by_default():
    from kvtier.integrations.vllm.metrics import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve(port)
    assert _listen_addr(port) == "0100007F"      # 127.0.0.1, little-endian hex: not 0.0.0.0
    assert KvtierConfig().metrics.host == "127.0.0.1"


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def _disk_store(path: Path, **disk):
    from kvtier.keys import Namespace
    from kvtier.store import TieredStore

    cfg = StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False},
                                      "disk": {"enabled": True, "path": str(path), "capacity": 10**7, **disk}})
    return TieredStore.open(cfg, Namespace("m", "f", "float32", "L", 4, 4))


def test_disk_tier_files_and_directories_are_owner_only(tmp_path):
    from kvtier.keys import chunk_keys

    with _disk_store(tmp_path / "ssd") as s:
        key = chunk_keys(s.namespace, [1, 2, 3, 4])[0]
        assert s.put(key, None, b"x" * 100, num_tokens=4, shape=(100,), dtype="uint8")
        assert s.flush(10)
    modes = {p.relative_to(tmp_path): stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ssd").rglob("*")}
    files = {p: m for p, m in modes.items() if (tmp_path / p).is_file()}
    dirs = {p: m for p, m in modes.items() if (tmp_path / p).is_dir()}
    assert files and all(m & 0o077 == 0 for m in files.values()), files
    assert dirs and all(m & 0o077 == 0 for m in dirs.values()), dirs
    assert stat.S_IMODE((tmp_path / "ssd").stat().st_mode) == 0o700


def test_world_writable_ssd_directory_disables_the_tier_with_a_counted_event(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with _disk_store(d) as s:
        assert s.stats()["tiers"] == {} or "disk" not in s.stats()["tiers"]
        assert s.stats()["counters"].get("events.unsafe_dir") == 1
    with _disk_store(d, allow_shared_dir=True) as s:
        assert "disk" in s.stats()["tiers"]
