"""Small helpers around vLLM's offline ``LLM`` for the bundled model (greedy, eager).

Import only after ``kvtier.runtime.apply_vllm_env()``; used by ``kvtier generate``, ``doctor``,
benchmarks and tests. The dtype defaults to "auto": ``kvtier.compute.choose_dtype`` picks the
one this CPU computes fast (said once per process, with the reason).
"""

from __future__ import annotations

from typing import Any

from kvtier.compute import DtypeChoice, announce, choose_dtype


def resolve_dtype(dtype: str | DtypeChoice) -> DtypeChoice:
    """A DtypeChoice as is; a name ("auto", "float32", ...) through choose_dtype (source "config")."""
    return dtype if isinstance(dtype, DtypeChoice) else choose_dtype(dtype, source="config")


def make_llm(model: str, *, dtype: str | DtypeChoice = "auto", max_model_len: int = 4096,
             kv_transfer_config: dict[str, Any] | None = None, **engine_args: Any):
    """An offline vLLM engine with kvtier's defaults for this CPU machine."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    choice = resolve_dtype(dtype)
    announce(choice)
    kvt = KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None
    return LLM(model=model, dtype=choice.dtype, enforce_eager=True, max_model_len=max_model_len,
               kv_transfer_config=kvt, **engine_args)


def chat_answer(llm, prompt: str, max_tokens: int = 64, answer_start: str | None = None) -> str:
    """The greedy answer of ``llm`` to one user message (chat template applied). With ``answer_start``
    the assistant's message begins with it and the engine continues it: the result is the continuation."""
    from vllm import SamplingParams

    messages = [{"role": "user", "content": prompt}]
    if answer_start:
        messages.append({"role": "assistant", "content": answer_start})
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False,
                   add_generation_prompt=not answer_start, continue_final_message=bool(answer_start))
    return out[0].outputs[0].text


def offline_chat(model: str, prompt: str, *, max_tokens: int = 64, dtype: str | DtypeChoice = "auto") -> str:
    return chat_answer(make_llm(model, dtype=dtype, max_model_len=2048), prompt, max_tokens)
