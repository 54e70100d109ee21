"""Seeded random-initialised tiny checkpoints of the architectures kvtier must cover, for tests.

vLLM's dummy weights make degenerate greedy outputs (two tokens alternating), so a hit that returns
"the same tokens" proves little with them. These checkpoints are made once with transformers'
``AutoModelForCausalLM.from_config`` under a fixed seed, every weight matrix drawn from normal(0, std)
(the config's ``initializer_range``; std chosen per architecture so greedy outputs vary), saved as float32
safetensors with the bundled SmolLM2 tokenizer (vocabulary 49,152) into
``<kvtier home>/models/tiny/<name>-<spec hash>/``, published atomically. ``ensure_tiny(name)`` is
idempotent: the folder is keyed by a content hash of the spec, so a changed spec makes a new folder.

- ``mistral-swa``: Mistral, every layer sliding window 256 (one sliding-window KV-cache group).
- ``llama-kv4``: Llama with 4 KV heads (tensor parallelism 2 splits them, 2 per rank).
- ``deepseek-mla``: DeepSeek-V2 MLA (kv_lora_rank 512 + qk_rope_head_dim 64, what vLLM's CPU MLA kernel
  takes; serve with block size 16), dense MLP layers.
- ``qwen3-next``: Qwen3-Next, three Gated DeltaNet linear-attention layers + one full-attention layer, MoE
  MLP (the CPU GDN kernel needs bfloat16: serve it in bfloat16).
- ``gemma3-tiny``: Gemma 3 text, three sliding-window (256) layers + one global layer, 2 KV heads.

``python -m kvtier.models.tiny [NAME ...]`` makes them (all without names) and prints their folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import kvtier_home
from kvtier.models.bundled import DEFAULT, ModelError

MAKER_VERSION = 1
MARKER = "kvtier-tiny.json"
VOCAB = 49152                                  # the SmolLM2 tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPT = "The history of the city begins with a small settlement on the river, where"


@dataclass(frozen=True)
class TinySpec:
    """One tiny checkpoint: a transformers ``model_type`` and its config fields (JSON values), the seed and
    the std of the weights, and the dtype vLLM must serve it in."""

    name: str
    model_type: str
    fields: tuple[tuple[str, object], ...]
    serve_dtype: str = "float32"
    block_size: int | None = None
    seed: int = 1234
    std: float = 0.08
    notes: str = field(default="", compare=False)

    def config_fields(self) -> dict[str, object]:
        common = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                  "initializer_range": self.std, "tie_word_embeddings": False, "max_position_embeddings": 4096}
        return common | dict(self.fields)

    def digest(self) -> str:
        """A content hash of everything that shapes the weights (12 hex digits)."""
        doc = {"maker": MAKER_VERSION, "model_type": self.model_type, "fields": self.config_fields(),
               "seed": self.seed, "std": self.std}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]

    def path(self) -> Path:
        return kvtier_home() / "models" / "tiny" / f"{self.name}-{self.digest()}"


_ATTN = (("hidden_size", 256), ("intermediate_size", 512), ("num_attention_heads", 4), ("head_dim", 64),
         ("rms_norm_eps", 1e-6))
TINY: dict[str, TinySpec] = {s.name: s for s in (
    TinySpec("mistral-swa", "mistral", _ATTN + (("num_hidden_layers", 2), ("num_key_value_heads", 2),
                                                 ("sliding_window", 256))),
    TinySpec("llama-kv4", "llama", (("hidden_size", 256), ("intermediate_size", 512), ("num_attention_heads", 8),
                                    ("head_dim", 64), ("num_key_value_heads", 4), ("num_hidden_layers", 2))),
    TinySpec("deepseek-mla", "deepseek_v2", (
        ("hidden_size", 256), ("intermediate_size", 512), ("num_hidden_layers", 2), ("num_attention_heads", 4),
        ("num_key_value_heads", 4), ("kv_lora_rank", 512), ("q_lora_rank", None), ("qk_rope_head_dim", 64),
        ("qk_nope_head_dim", 128), ("v_head_dim", 128), ("first_k_dense_replace", 2), ("n_routed_experts", 4),
        ("num_experts_per_tok", 2), ("moe_intermediate_size", 128), ("n_shared_experts", 1),
        ("rope_scaling", None)), block_size=16),
    TinySpec("qwen3-next", "qwen3_next", (
        ("hidden_size", 256), ("intermediate_size", 512), ("num_hidden_layers", 4), ("num_attention_heads", 4),
        ("num_key_value_heads", 2), ("head_dim", 64), ("full_attention_interval", 4),
        ("layer_types", ["linear_attention"] * 3 + ["full_attention"]),
        ("linear_num_key_heads", 4), ("linear_num_value_heads", 8), ("linear_key_head_dim", 64),
        ("linear_value_head_dim", 64), ("linear_conv_kernel_dim", 4), ("num_experts", 4),
        ("num_experts_per_tok", 2), ("moe_intermediate_size", 128), ("shared_expert_intermediate_size", 128),
        ("decoder_sparse_step", 1), ("mlp_only_layers", [])), serve_dtype="bfloat16"),
    TinySpec("gemma3-tiny", "gemma3_text", _ATTN + (
        ("num_hidden_layers", 4), ("num_key_value_heads", 2), ("sliding_window", 256),
        ("layer_types", ["sliding_attention"] * 3 + ["full_attention"]), ("query_pre_attn_scalar", 64))),
)}


def tiny_spec(name: str) -> TinySpec:
    """The tiny spec called ``name``; a one-line ``ModelError`` naming the known ones otherwise."""
    try:
        return TINY[name]
    except KeyError:
        raise ModelError(f"unknown tiny model {name!r} (known: {', '.join(TINY)})") from None


def greedy_tokens(folder: Path, n: int = 12) -> list[int]:
    """The float32 transformers model's greedy continuation of ``PROMPT`` (token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def varied(tokens: list[int]) -> bool:
    """Whether a greedy output varies: at least 4 distinct tokens, not a loop of two alternating."""
    return len(set(tokens)) >= 4


def make_tiny(spec: TinySpec, dest: Path) -> Path:
    """Make the checkpoint into ``dest`` (atomic publish); ``ModelError`` if its greedy output does not vary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer_dir = DEFAULT.path()
    missing = [f for f in TOKENIZER_FILES[:2] if not (tokenizer_dir / f).is_file()]
    if missing:
        raise ModelError(f"the bundled tokenizer is missing at {tokenizer_dir} ({', '.join(missing)}): "
                         "run `make setup` first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        config = AutoConfig.for_model(spec.model_type, **spec.config_fields())
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        for f in TOKENIZER_FILES:
            if (tokenizer_dir / f).is_file():
                shutil.copyfile(tokenizer_dir / f, tmp / f)
        tokens = greedy_tokens(tmp)
        if not varied(tokens):
            raise ModelError(f"tiny model {spec.name}: greedy output does not vary ({tokens}); change its std")
        (tmp / MARKER).write_text(json.dumps({"name": spec.name, "digest": spec.digest(), "seed": spec.seed,
                                              "std": spec.std, "serve_dtype": spec.serve_dtype,
                                              "block_size": spec.block_size, "greedy_tokens": tokens}, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_tiny(name: str) -> Path:
    """The folder of the tiny model ``name``, made once (idempotent, fast when done)."""
    spec = tiny_spec(name)
    dest = spec.path()
    if (dest / MARKER).is_file():
        return dest
    return make_tiny(spec, dest)


def main(argv: list[str]) -> int:
    try:
        for name in argv or list(TINY):
            print(f"{name}: {ensure_tiny(name)}", flush=True)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
