"""Driver for the model-coverage oracle: does a hit from each tier give a cold recompute's output, on a
model whose KV is not one full-attention group (sliding-window + global layers, MLA)?

Run as a subprocess (the test controls the environment)::

    python tests/integration/model_hit_driver.py ROLE --model DIR --dtype D --out OUT.json [--disk DIR]
        [--shared DIR] [--tier ssd|shared]

ROLE is one of
  reference  no kvtier, no prefix caching: each prompt alone (greedy ids + top-k logprobs)
  writer     kvtier with RAM + SSD (+ the shared directory, written through): each prompt cold (saved),
             then again after ``reset_prefix_cache`` (a hit from kvtier's RAM)
  reader     kvtier in a new process, RAM off: ``--tier ssd`` reads the writer's SSD directory, ``--tier
             shared`` only the shared directory (no SSD)
  With ``--tp 2`` the engine runs two tensor-parallel ranks (one core each); ``--corrupt-rank R`` (reader)
  first corrupts every chunk file rank R wrote, so that rank's loads fail while the others' succeed;
  ``--tp-layout per-kv-head`` stores chunks per KV head (any TP size reads them); ``--vllm-hit`` (writer) runs
  each prompt a second time on vLLM's own prefix cache, the oracle where a cold run computes differently.
  start      kvtier with RAM (``--on-unsupported`` as given): start the engine, generate once; an engine
             kvtier refuses ends the process with its error on stderr

Every role reports the engine's facts: vLLM's KV-cache groups (spec kind, layer count), whether the
hybrid KV cache manager is on, and the number of KV blocks vLLM allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import connector_driver as cd  # noqa: E402  (the prompts and the phase runner)

CHUNK = 256
MAX_MODEL_LEN = 2048
MAX_BATCHED = 512
PROMPT_LENGTHS = (1100, 700)         # one hit past a 512-token window, one inside it


def _prompts(tok) -> dict[str, list[int]]:
    return {f"doc_{n}": cd._tokens(tok, f"model-doc-{n}", n) for n in PROMPT_LENGTHS}


def _engine_facts(llm) -> dict:
    """vLLM's groups, HMA on or off, KV blocks (the in-process engine's scheduler)."""
    cfg = llm.llm_engine.vllm_config
    facts = {"hma_disabled": cfg.scheduler_config.disable_hybrid_kv_cache_manager,
             "num_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size,
             "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill}
    core = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(core, "engine_core", core)
    sched = getattr(core, "scheduler", None)
    kcc = getattr(sched, "kv_cache_config", None)
    if kcc is not None:
        facts["groups"] = [[type(g.kv_cache_spec).__name__, len(g.layer_names)] for g in kcc.kv_cache_groups]
        facts["num_blocks"] = kcc.num_blocks
    return facts


def _corrupt_rank(disk: Path, rank: int) -> int:
    """Corrupt every chunk file in the namespaces of TP rank ``rank``; how many."""
    n = 0
    for ns_file in disk.glob("*/namespace.json"):
        ns = json.loads(ns_file.read_text())["namespace"]
        if ns.get("tp_size", 1) > 1 and ns.get("tp_rank", 0) == rank:
            for f in (ns_file.parent / "chunks").rglob("*"):
                if f.is_file() and not f.name.startswith("."):
                    cd._corrupt(f)
                    n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["reference", "writer", "reader", "start"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk")
    ap.add_argument("--shared")
    ap.add_argument("--tier", choices=["ssd", "shared"], default="ssd")
    ap.add_argument("--log")
    ap.add_argument("--on-unsupported", default="fail")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--corrupt-rank", type=int)
    ap.add_argument("--tp-layout", default="per-rank", choices=["per-rank", "per-kv-head"])
    ap.add_argument("--vllm-hit", action="store_true", help="writer: each prompt again on vLLM's own prefix cache")
    args = ap.parse_args()

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # the engine in this process: its facts are readable
    if args.tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp))
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    kvt = None
    log_path = Path(args.log) if args.log else None
    if args.role != "reference":
        ram = args.role == "writer"
        disk = args.role == "writer" or (args.role == "reader" and args.tier == "ssd")
        store = {"chunk_size": CHUNK, "memory": {"enabled": ram, "capacity": "512MiB"},
                 "disk": {"enabled": disk, "path": args.disk, "capacity": "2GiB", "rescan_interval_s": 0.2}}
        if args.shared and (args.role == "writer" or args.tier == "shared"):
            store["shared"] = {"kind": "sharedfs", "path": args.shared, "capacity": "2GiB", "create": True}
        kvt = kv_transfer_config({"store": store, "connector": {"request_log": str(log_path) if log_path else None,
                                                                "on_unsupported": args.on_unsupported,
                                                                "tp_layout": args.tp_layout}})
    llm = make_llm(args.model, dtype=args.dtype, max_model_len=MAX_MODEL_LEN, kv_transfer_config=kvt,
                   max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=args.role != "reference",
                   seed=0, disable_log_stats=False, tensor_parallel_size=args.tp)
    prompts = _prompts(llm.get_tokenizer())
    ph = cd.Phases(llm, log_path)
    ph.result["engine"] = _engine_facts(llm)
    if args.role == "start":
        name, p = next(iter(prompts.items()))
        ph.run(name, {name: p}, reset_prefix_cache=False)
    elif args.role == "reference":
        for name, p in prompts.items():
            ph.run(name, {name: p}, reset_prefix_cache=False)
    elif args.role == "writer":
        for name, p in prompts.items():
            ph.run(f"cold_{name}", {name: p})
            if args.vllm_hit:
                ph.run(f"vllm_{name}", {name: p}, reset_prefix_cache=False)   # vLLM's own hit: the oracle
        cd._flush_store()
        for name, p in prompts.items():
            ph.run(f"ram_{name}", {name: p})      # vLLM's prefix cache reset: the hit comes from kvtier
    else:
        if args.corrupt_rank is not None:
            ph.result["corrupted"] = _corrupt_rank(Path(args.disk), args.corrupt_rank)
        time.sleep(0.5)
        for name, p in prompts.items():
            ph.run(f"{args.tier}_{name}", {name: p})
    cd._flush_store()
    Path(args.out).write_text(json.dumps({"phases": ph.result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
