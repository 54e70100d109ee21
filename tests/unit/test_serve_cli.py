"""``kvtier serve`` (dry run): the vLLM command it builds, the config file it writes, the backend rules."""

from __future__ import annotations

import json
import shlex
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtier.commands.serve_cmd as serve_cmd
from kvtier.cli import _register_all, app
from kvtier.config import load_config

_register_all()
runner = CliRunner()


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Config files go under a private kvtier home; no KVTIER_* from the caller's shell leaks in."""
    import os

    for name in list(os.environ):
        if name.startswith("KVTIER_") or name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_API_KEY"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))


def _backend(monkeypatch, cpu: bool) -> None:
    monkeypatch.setattr(serve_cmd, "cpu_backend", lambda: cpu)


def dry_run(*args: str):
    """(exit result, vLLM argv, the env assignments before it, the kv-transfer-config dict)."""
    r = runner.invoke(app, ["serve", "--dry-run", *args])
    assert r.exit_code == 0, r.output
    words = shlex.split(r.stdout)
    assignments: dict[str, str] = {}
    if words[0] == "env":
        i = 1
        while "=" not in words[i]:
            i += 2                                 # -u NAME
        while "=" in words[i] and not words[i].startswith("-"):
            k, v = words[i].split("=", 1)
            assignments[k] = v
            i += 1
        words = words[i:]
    kvt = json.loads(words[words.index("--kv-transfer-config") + 1])
    return r, words, assignments, kvt


def written(kvt: dict) -> Path:
    extra = kvt["kv_connector_extra_config"]
    assert set(extra) == {"kvtier_config_file"}          # a file, never an inline kvtier_config
    return Path(extra["kvtier_config_file"])


def test_positional_hf_id_and_passthrough(monkeypatch):
    _backend(monkeypatch, True)
    r, argv, env, kvt = dry_run("Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192", "--enable-prefix-caching")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "Qwen/Qwen2.5-7B-Instruct"
    assert argv[-3:] == ["--max-model-len", "8192", "--enable-prefix-caching"]
    assert kvt["kv_connector"] == "KvtierConnector"
    assert kvt["kv_connector_module_path"] == "kvtier.integrations.vllm.connector"
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env   # an HF id may download
    assert "config written to" in r.stderr and str(written(kvt)) in r.stderr


def test_bundled_model_when_omitted_and_the_old_double_dash_form(monkeypatch, tmp_path):
    from kvtier.model import default_model_path

    _backend(monkeypatch, True)
    for args in (["--", "--max-model-len", "8192"], ["--max-model-len", "8192"]):
        _, argv, env, _ = dry_run(*args)
        assert argv[argv.index("--model") + 1] == str(default_model_path())
        assert argv[-2:] == ["--max-model-len", "8192"]
        assert env.get("HF_HUB_OFFLINE") == "1"             # the bundled model is local


def test_cpu_backend_forces_dtype_and_eager(monkeypatch):
    _backend(monkeypatch, True)
    _, argv, env, _ = dry_run("Qwen/Qwen2.5-7B-Instruct")
    assert "--enforce-eager" in argv
    assert argv[argv.index("--dtype") + 1] in ("float32", "bfloat16")
    assert "VLLM_CPU_KVCACHE_SPACE" in env and "VLLM_CACHE_ROOT" in env     # kvtier.runtime.vllm_env
    _, argv, env, _ = dry_run("M", "--max-model-len", "64", "--kv-cache-memory-bytes", "1000000")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env     # it would override the explicit byte count


def test_gpu_backend_leaves_vllm_defaults(monkeypatch):
    _backend(monkeypatch, False)
    _, argv, env, _ = dry_run("Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8192")
    assert "--enforce-eager" not in argv and "--dtype" not in argv
    assert not env                                # vLLM's own environment, untouched
    _, argv, _, _ = dry_run("Qwen/Qwen2.5-7B-Instruct", "--dtype", "half")
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "half"   # passed as given
    _, argv, _, _ = dry_run("Qwen/Qwen2.5-7B-Instruct", "--", "--dtype", "bfloat16")
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"


def test_explicit_dtype_on_cpu_is_validated(monkeypatch):
    _backend(monkeypatch, True)
    _, argv, _, _ = dry_run("M", "--dtype", "float16")
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "float16"
    r = runner.invoke(app, ["serve", "--dry-run", "M", "--dtype", "int4"])
    assert r.exit_code != 0 and "int4" in r.output


def test_host_is_vllms_default_unless_given(monkeypatch):
    _backend(monkeypatch, False)
    r, argv, _, kvt = dry_run("M")
    assert "--host" not in argv and "--port" not in argv
    assert "all interfaces" in r.stderr and "--api-key" in r.stderr        # warned, not refused
    cfg = load_config(written(kvt), env={})
    assert cfg.metrics.port == 9400 and cfg.metrics.host == "0.0.0.0"      # metrics on, where the API is
    r, argv, _, kvt = dry_run("M", "--host", "127.0.0.1", "--port", "8100")
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8100"
    assert "reachable from the network" not in r.stderr
    assert load_config(written(kvt), env={}).metrics.host == "127.0.0.1"
    r, argv, _, _ = dry_run("M", "--api-key", "k")
    assert "without --api-key" not in r.stderr


def test_metrics_port_and_off(monkeypatch):
    _backend(monkeypatch, False)
    _, _, _, kvt = dry_run("M", "--metrics-port", "9500")
    assert load_config(written(kvt), env={}).metrics.port == 9500
    _, _, _, kvt = dry_run("M", "--metrics-port", "0")
    assert load_config(written(kvt), env={}).metrics.port is None


def test_tier_flags_and_written_file(monkeypatch, tmp_path):
    _backend(monkeypatch, True)
    ssd = tmp_path / "ssd"
    _, _, _, kvt = dry_run("M", "--memory-capacity", "1GiB", "--disk-path", str(ssd), "--disk-capacity", "3GiB",
                           "--chunk-size", "512")
    path = written(kvt)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cfg = load_config(path, env={})
    assert cfg.store.memory.capacity == 2**30 and cfg.store.chunk_size == 512
    assert cfg.store.disk.enabled and cfg.store.disk.path == ssd and cfg.store.disk.capacity == 3 * 2**30
    assert not ssd.exists()                      # a dry run creates nothing but the config file
    r = runner.invoke(app, ["serve", "--dry-run", "M", "--disk-capacity", "3GiB"])
    assert r.exit_code == 2 and "--disk-path" in r.output


def test_old_flag_names_are_hidden_aliases(monkeypatch, tmp_path):
    _backend(monkeypatch, True)
    r, argv, _, kvt = dry_run("--ram", "1GiB", "--disk", str(tmp_path / "ssd"), "--model", str(tmp_path),
                              "--", "--max-model-len", "8192")
    cfg = load_config(written(kvt), env={})
    assert cfg.store.memory.capacity == 2**30 and cfg.store.disk.path == tmp_path / "ssd"
    assert argv[argv.index("--model") + 1] == str(tmp_path)
    assert "--ram is deprecated" in r.stderr and "--disk is deprecated" in r.stderr
    assert "--model is deprecated" in r.stderr
    help_text = runner.invoke(app, ["serve", "--help"]).output
    assert "--memory-capacity" in help_text and "--ram" not in help_text and "--model" not in help_text


def test_config_file_from_option_and_environment(monkeypatch, tmp_path):
    _backend(monkeypatch, True)
    f = tmp_path / "kvtier.yaml"
    f.write_text("store:\n  memory: {capacity: 3GiB}\n  disk: {enabled: true, path: /nonexistent/kvtier}\n")
    _, _, _, kvt = dry_run("M", "--config", str(f), "--disk-path", str(tmp_path / "d"))   # flags beat the file
    cfg = load_config(written(kvt), env={})
    assert cfg.store.memory.capacity == 3 * 2**30 and cfg.store.disk.path == tmp_path / "d"
    monkeypatch.setenv("KVTIER_CONFIG_FILE", str(f))
    _, _, _, kvt = dry_run("M")
    assert load_config(written(kvt), env={}).store.memory.capacity == 3 * 2**30


def test_environment_overrides_are_in_the_file_not_in_vllms_env(monkeypatch):
    _backend(monkeypatch, True)
    monkeypatch.setenv("KVTIER_STORE__MEMORY__CAPACITY", "5GiB")
    r = runner.invoke(app, ["serve", "--dry-run", "M", "--memory-capacity", "1GiB"])
    assert r.exit_code == 0, r.output
    words = shlex.split(r.stdout)
    assert words[:3] == ["env", "-u", "KVTIER_STORE__MEMORY__CAPACITY"]     # the file holds the winner
    kvt = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert load_config(written(kvt), env={}).store.memory.capacity == 2**30


def test_secrets_stay_out_of_the_command_and_the_file(monkeypatch, tmp_path):
    _backend(monkeypatch, True)
    secret = "s3cret-password-0123456789"
    f = tmp_path / "valkey.yaml"
    f.write_text(f"store:\n  shared: {{kind: valkey, url: 'redis://h:6379/0', password: {secret}}}\n")
    r, _, _, kvt = dry_run("M", "--config", str(f))
    assert secret not in r.stdout and secret not in r.stderr and secret not in written(kvt).read_text()
    assert "KVTIER_STORE__SHARED__PASSWORD" in r.stderr                   # named, so it can be set
    again = load_config(written(kvt), env={"KVTIER_STORE__SHARED__PASSWORD": secret})
    assert again.store.shared.password.get_secret_value() == secret


def test_flags_kvtier_sets_are_refused_in_the_passthrough(monkeypatch):
    _backend(monkeypatch, True)
    r = runner.invoke(app, ["serve", "--dry-run", "M", "--kv-transfer-config", "{}"])
    assert r.exit_code == 2 and "--kv-transfer-config" in r.output


def test_chunk_size_must_be_a_multiple_of_the_block(monkeypatch):
    _backend(monkeypatch, True)
    assert runner.invoke(app, ["serve", "--dry-run", "--chunk-size", "200"]).exit_code == 2
    r = runner.invoke(app, ["serve", "--dry-run", "--chunk-size", "192", "--", "--block-size", "64"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["serve", "--dry-run", "M", "--chunk-size", "192", "--block-size=64"])
    assert r.exit_code == 0, r.output
    assert runner.invoke(app, ["serve", "--dry-run", "--memory-capacity", "lots"]).exit_code == 2


def test_kvtier_config_file_env_in_the_connector(monkeypatch, tmp_path):
    from kvtier.integrations.vllm.extra_config import config_from_extra

    f = tmp_path / "kvtier.yaml"
    f.write_text("store:\n  chunk_size: 512\n")
    env = {"KVTIER_CONFIG_FILE": str(f)}
    assert config_from_extra({}, env=env).store.chunk_size == 512
    assert config_from_extra(None, env=env).store.chunk_size == 512
    # an explicit file or inline config in the extra config wins over the variable
    other = tmp_path / "other.yaml"
    other.write_text("store:\n  chunk_size: 1024\n")
    assert config_from_extra({"kvtier_config_file": str(other)}, env=env).store.chunk_size == 1024
    assert config_from_extra({"kvtier_config": {"store": {"eviction": "cost"}}}, env=env).store.chunk_size == 256
    monkeypatch.setenv("KVTIER_CONFIG_FILE", str(f))
    assert config_from_extra({}).store.chunk_size == 512
