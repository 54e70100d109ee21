"""Named profiles (``--profile NAME``) and the lookup of a profile argument.

A preset is ``ACCELERATOR/MODEL`` (e.g. ``h100/llama-3-8b``), built from three tables whose
every number is derived in docs/simulator.md ("Presets"):

* models: KV bytes per token = 2 (K and V) x layers x KV heads x head dim x 2 (bf16); for an
  MLA model (DeepSeek-V3) layers x (kv_lora_rank + rope dim) x 2; parameters for FLOPs/bytes.
* accelerators: dense bf16 peak FLOP/s and HBM bandwidth from the vendors' data sheets, HBM size.
  Prefill is compute-bound: ``prefill_token_s = 2 x params / (MFU x peak)``, attention
  ``prefill_attn_s = 4 x layers x heads x head_dim / (MFU x peak)`` per (query, key) pair.
  Decode is bandwidth-bound: one step streams the weights (``step_overhead_s = weight bytes /
  (eff x HBM bw)`` + a fixed launch cost) and each sequence's KV (``decode_ctx_s = KV bytes per
  token / (eff x HBM bw)``). KV cache = ``kv_fraction x HBM - weights``.
* storage (``STORAGE``): RAM over PCIe, NVMe Gen4 / Gen5, a distributed filesystem client, a
  network KV store; the tiers of a preset get them with capacity 0 (set with --memory-capacity,
  --disk-capacity, --shared-capacity).

``resolve_profile(None)`` gives the ``DEFAULT_PRESET`` (h100/llama-3-8b); a path is read as YAML.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.sim.profile import EngineProfile, ProfileError, SimProfile, TierProfile, load_profile


@dataclass(frozen=True)
class ModelFacts:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    params_b: float              # billions (active parameters for MoE)
    weight_bytes_b: float        # billions of bytes of weights on one accelerator (bf16 = 2 x params)
    mla_kv_dim: int = 0          # MLA: latent + rope values cached per token per layer

    @property
    def kv_bytes_per_token(self) -> int:
        if self.mla_kv_dim:
            return self.layers * self.mla_kv_dim * 2
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Accelerator:
    bf16_flops: float            # dense peak FLOP/s
    hbm_bw: float                # bytes/s
    hbm_bytes: float
    pcie_bw: float               # host <-> device bytes/s (practical)


MODELS: dict[str, ModelFacts] = {
    "llama-3-8b": ModelFacts(32, 32, 8, 128, 8.0, 16.1),
    "qwen2.5-7b": ModelFacts(28, 28, 4, 128, 7.6, 15.2),
    "llama-3-70b": ModelFacts(80, 64, 8, 128, 70.6, 141.0),          # weights across 8 GPUs (TP8): see docs
    "deepseek-v3": ModelFacts(61, 128, 128, 128, 37.0, 671.0, mla_kv_dim=576),   # FP8 weights: 1 B/param
    "qwen2.5-1.5b": ModelFacts(28, 12, 2, 128, 1.54, 3.1),
}
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(989e12, 3.35e12, 80e9, 50e9),
    "h200": Accelerator(989e12, 4.8e12, 141e9, 50e9),
    "l20": Accelerator(119.5e12, 0.864e12, 48e9, 25e9),
    "t4": Accelerator(65e12, 0.32e12, 16e9, 12e9),
}
# read bytes/s, write bytes/s, per-batch latency s
STORAGE: dict[str, tuple[float, float, float]] = {
    "nvme-gen4": (7.0e9, 5.0e9, 1e-4),
    "nvme-gen5": (14.0e9, 10.0e9, 8e-5),
    "dfs-client": (5.0e9, 3.0e9, 1e-3),
    "valkey": (1.2e9, 1.0e9, 5e-4),
    "mooncake-rdma": (20e9, 20e9, 1e-4),
}
MFU = 0.5          # prefill model-FLOPs utilisation (assumption; docs/simulator.md)
HBM_EFF = 0.7      # achieved fraction of HBM bandwidth in decode (assumption)
KV_FRACTION = 0.9  # vLLM gpu_memory_utilization default
GPU_COUNT = {"llama-3-70b": 8, "deepseek-v3": 8}   # tensor parallel degree assumed for the big models


def make_preset(acc_name: str, model_name: str, ssd: str = "nvme-gen4", shared: str = "mooncake-rdma") -> SimProfile:
    a, m = ACCELERATORS[acc_name], MODELS[model_name]
    n = GPU_COUNT.get(model_name, 1)
    flops, bw, hbm = a.bf16_flops * n, a.hbm_bw * n, a.hbm_bytes * n
    kv_tokens = max(0, int((KV_FRACTION * hbm - m.weight_bytes_b * 1e9) // m.kv_bytes_per_token))
    if kv_tokens < 16 * 1024:
        raise ProfileError(f"{model_name} does not fit on {n} x {acc_name} with room for a KV cache")
    eng = EngineProfile(
        block_size=16, max_num_batched_tokens=8192, max_num_seqs=256, kv_cache_tokens=kv_tokens,
        step_overhead_s=m.weight_bytes_b * 1e9 / (HBM_EFF * bw) + 0.002,
        prefill_token_s=2 * m.params_b * 1e9 / (MFU * flops),
        prefill_attn_s=4 * m.layers * m.heads * m.head_dim / (MFU * flops),
        decode_seq_s=2 * m.params_b * 1e9 / (MFU * flops),
        decode_ctx_s=m.kv_bytes_per_token / (HBM_EFF * bw), request_overhead_s=0.005)
    sr, sw, sl = STORAGE[ssd]
    hr, hw, hl = STORAGE[shared]
    return SimProfile(
        description=f"preset {acc_name}/{model_name} ({n} GPU{'s' if n > 1 else ''}), SSD {ssd}, shared {shared}",
        source="kvtier.sim.presets: data-sheet figures + stated MFU/efficiency assumptions (docs/simulator.md)",
        kv_bytes_per_token=m.kv_bytes_per_token, chunk_size=256, engine=eng,
        ram=TierProfile(capacity=0, read_bw=a.pcie_bw * n, write_bw=a.pcie_bw * n, op_latency_s=2e-5),
        ssd=TierProfile(capacity=0, read_bw=sr * n, write_bw=sw * n, op_latency_s=sl),
        shared=TierProfile(capacity=0, read_bw=hr * n, write_bw=hw * n, op_latency_s=hl))


def preset_names() -> list[str]:
    return [f"{a}/{m}" for a in ACCELERATORS for m in MODELS]


DEFAULT_PRESET = "h100/llama-3-8b"


def resolve_profile(arg: Path | str | None) -> SimProfile:
    if arg is None:
        arg = DEFAULT_PRESET
    name = str(arg)
    if "/" in name and name.count("/") == 1 and not Path(name).exists():
        acc, model = name.split("/")
        if acc in ACCELERATORS and model in MODELS:
            return make_preset(acc, model)
    p = Path(name)
    if not p.exists() and p.suffix not in (".yaml", ".yml"):
        raise ProfileError(f"unknown profile {name!r}: not a file and not a preset (e.g. h100/llama-3-8b; "
                           f"accelerators {', '.join(ACCELERATORS)}; models {', '.join(MODELS)})")
    return load_profile(p)
