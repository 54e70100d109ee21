"""Driver for ``test_save_generated.py`` (and ``benchmarks/chat/decode_kv_diff.py``): one vLLM-cpu
engine in this process, two chat turns sent as token ids (no tokenization drift)::

    python tests/integration/save_generated_driver.py ROLE --model DIR --out OUT.json \
        [--prompt-tokens 200] [--gen-tokens 330] [--question-tokens 30] [--dump DIR]

ROLE
  kvtier     kvtier (RAM tier), ``connector.save_generated`` on, vLLM's prefix cache on. Turn 1
             (a seeded prompt shorter than one chunk) generates ``--gen-tokens`` greedy tokens
             (ignore_eos): the chunks covering them are saved during decode. vLLM's prefix cache
             is reset; turn 2 = turn-1 prompt ids + generated ids + a new question: its hit can
             only be kvtier's chunks of the generated tokens.
  reference  kvtier with ``save_generated`` off, no prefix caching: the same two turns. Turn 1
             saves nothing (its prompt has no full chunk), so turn 2 loads nothing and is a fresh
             prefill (the output without the hit); its prompt chunks are saved from that prefill.

Each role writes per turn: ids, top-k logprobs, vLLM's ``num_cached_tokens``, the request-log
events, kvtier / vLLM counter deltas; with ``--dump`` the payloads of turn 2's first chunks
(decode-time KV for ``kvtier``, prefill KV for ``reference``) as ``.npy`` files. float32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from connector_driver import TOP_K, _kvtier_counters, _tokens, _vllm_counters  # noqa: E402  (same oracle inputs)

CHUNK = 256
MAX_MODEL_LEN = 2048


def run_turn(llm, log: Path, prompt: list[int], max_tokens: int, reset: bool) -> dict:
    """One request alone (greedy, ignore_eos, top-k logprobs): outputs, request-log events and
    counter deltas (the same record as ``connector_driver.Phases.run``)."""
    from vllm import SamplingParams, TokensPrompt

    reset_ok = llm.reset_prefix_cache() if reset else None
    start = log.stat().st_size if log.exists() else 0
    before, kv_before = _vllm_counters(llm), _kvtier_counters()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    after, kv_after = _vllm_counters(llm), _kvtier_counters()
    c = o.outputs[0]
    topk = [sorted(([int(t), float(lp.logprob), int(lp.rank)] for t, lp in step.items()), key=lambda x: x[2])[:TOP_K]
            for step in c.logprobs]
    events = []
    if log.exists():
        with open(log) as f:
            f.seek(start)
            events = [json.loads(line) for line in f if line.strip()]
    return {"requests": [{"prompt_len": len(prompt), "ids": list(c.token_ids),
                          "topk": [[[t, lp] for t, lp, _ in s] for s in topk],
                          "num_cached_tokens": o.num_cached_tokens}],
            "log": events, "reset_ok": reset_ok, "vllm": {k: after[k] - before[k] for k in after},
            "kvtier": {k: v - kv_before.get(k, 0.0) for k, v in kv_after.items()
                       if v != kv_before.get(k, 0.0) and "_bucket" not in k}}


def _store():
    """This process's store (the connector halves share it: one engine process)."""
    from kvtier import store

    (s,) = {id(v): v for v in store._registry.values()}.values()
    return s


def _dump(keys: list[bytes], out: Path) -> list[str]:
    """Write each chunk ``keys[i]``'s payload from this process's store as ``chunk{i}.npy``."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, k in enumerate(keys):
        got = _store().get_with_meta(k)
        if got is None:
            raise SystemExit(f"chunk {i} of turn 2 is not in the store")
        meta, payload = got
        arr = np.frombuffer(bytes(payload), dtype=np.dtype(meta.dtype)).reshape(meta.shape)
        np.save(out / f"chunk{i}.npy", arr)
        written.append(str(out / f"chunk{i}.npy"))
    return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["kvtier", "reference"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--gen-tokens", type=int, default=330)
    ap.add_argument("--question-tokens", type=int, default=30)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--dump", help="write turn 2's chunk payloads here (.npy)")
    args = ap.parse_args()

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # scheduler, worker and store in this process
    from kvtier.engine import make_llm
    from kvtier.keys import chunk_keys
    from kvtier.server import kv_transfer_config

    kvtier_on = args.role == "kvtier"
    cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": "256MiB"}, "disk": {"enabled": False}},
           "connector": {"request_log": args.log, "save_generated": kvtier_on}}
    llm = make_llm(args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_transfer_config=kv_transfer_config(cfg),
                   enable_prefix_caching=kvtier_on, seed=0, disable_log_stats=False)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    tok = llm.get_tokenizer()
    prompt = _tokens(tok, "chat-turn-1", args.prompt_tokens)
    question = _tokens(tok, "chat-question-2", args.question_tokens)
    log = Path(args.log)
    result: dict = {"turn1": run_turn(llm, log, prompt, args.gen_tokens, reset=False)}
    generated = result["turn1"]["requests"][0]["ids"]
    turn2 = prompt + generated + question
    result["turn2"] = run_turn(llm, log, turn2, args.answer_tokens, reset=kvtier_on)
    _store().flush(30)
    result["geometry"] = {"block_size": block, "chunk_size": CHUNK, "top_k": TOP_K, "prompt_tokens": len(prompt),
                          "gen_tokens": len(generated), "turn2_tokens": len(turn2)}
    if args.dump:   # turn 2's chunks that hold only tokens with KV at the end of turn 1
        full = min(len(turn2) // CHUNK, (len(prompt) + len(generated) - 1) // CHUNK)
        result["dumps"] = _dump(chunk_keys(_store().namespace, turn2)[:full], Path(args.dump))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
