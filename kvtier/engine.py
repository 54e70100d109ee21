"""Small helpers around vLLM's offline ``LLM`` for the bundled model (greedy, eager).

Import only after ``kvtier.runtime.apply_vllm_env()``; used by ``kvtier generate`` and tests.
"""

from __future__ import annotations

from typing import Any


def make_llm(model: str, *, dtype: str = "bfloat16", max_model_len: int = 4096,
             kv_transfer_config: dict[str, Any] | None = None, **engine_args: Any):
    """An offline vLLM engine with kvtier's defaults for this CPU machine."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kvt = KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None
    return LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
               kv_transfer_config=kvt, **engine_args)


def offline_chat(model: str, prompt: str, *, max_tokens: int = 64, dtype: str = "bfloat16") -> str:
    from vllm import SamplingParams

    llm = make_llm(model, dtype=dtype, max_model_len=2048)
    out = llm.chat([{"role": "user", "content": prompt}],
                   SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return out[0].outputs[0].text
