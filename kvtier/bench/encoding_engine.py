"""Engine side of ``kvtier bench encoding``: one engine per subprocess
(``python -m kvtier.bench.encoding_engine ROLE ...``), in this process as in ``ttft_engine`` (kvtier's
counters are readable here). Every engine serves the same prompts (token ids from ``--prompts``), one at
a time, each after vLLM's prefix-cache reset (nothing comes from vLLM's own cache). Roles:

  write-DTYPE  kvtier with RAM and an SSD tier (``ttft_engine.kvtier_bench_config``), engine dtype DTYPE,
               empty: each prompt computed (``max_tokens=1``), then every chunk flushed to the SSD
               directory: the real KV chunks the codec and store figures and the readers' shared tier
               are made from
  vanilla      vLLM without kvtier, float32: the reference (full recompute), ``--max-output-tokens``
               greedy tokens per prompt with the chosen tokens' log-probabilities (``ignore_eos``)
  read-ENC     kvtier with a fresh RAM tier, no SSD, and the shared tier ``--shared`` (a sharedfs
               directory in encoding ENC, filled from write-float32's chunks by the orchestrator);
               ``claims.policy: always`` (every stored chunk is loaded: what is compared is the loaded
               KV, not the claim policy), ``connector.save: false``; float32; generates as vanilla

A reader's every prompt carries its evidence (``ttft_check.verify_kvtier_hit`` on that request's counter
deltas): the expected prefix tokens were loaded, every chunk read was served by the shared tier. A
prompt whose evidence fails is listed in ``violations`` (its tokens are still recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.ttft_engine import CHUNK, _flush_kvtier, _kvtier_samples, kvtier_bench_config

DTYPES = ("float32", "bfloat16")
READ_ENCODINGS = ("plain", "zstd", "int8")
ROLES = tuple(f"write-{d}" for d in DTYPES) + ("vanilla",) + tuple(f"read-{e}" for e in READ_ENCODINGS)
QUALITY_DTYPE = "float32"          # the reference, the readers and the chunks they load


def role_dtype(role: str) -> str:
    return role.split("-", 1)[1] if role.startswith("write-") else QUALITY_DTYPE


def reader_config(shared_dir: Path, encoding: str) -> dict:
    """A reader's kvtier config: fresh RAM, no SSD, the shared directory in ``encoding`` (the bench's
    deadlines: a busy 2-core machine must not turn a hit into a timeout)."""
    from kvtier.bench.shared_seed import reader_config as shared_reader

    return {"store": {"chunk_size": CHUNK, "memory": {"capacity": "1GiB"}, "disk": {"enabled": False},
                      "shared": shared_reader({"kind": "sharedfs", "path": str(shared_dir), "encoding": encoding})},
            "connector": {"load_timeout_s": 120.0, "save": False}, "claims": {"policy": "always"}}


def role_config(role: str, root: Path, shared_dir: Path | None) -> dict | None:
    if role.startswith("write-"):
        return kvtier_bench_config(root / role / "ssd")
    if role.startswith("read-"):
        if shared_dir is None:
            raise SystemExit(f"{role} needs --shared DIR")
        return reader_config(shared_dir, role.split("-", 1)[1])
    return None


def _evidence(sample: dict, prompt_tokens: int, block: int) -> list[str]:
    from kvtier.bench.ttft_check import HitEvidence, expected_hit_tokens, verify_kvtier_hit

    ev = HitEvidence(expected_hit_tokens(prompt_tokens, CHUNK, block), CHUNK, sample["reset_ok"], sample["cached"],
                     sample["kvtier"])
    return verify_kvtier_hit(ev, "sharedfs")


def serve(llm, prompt: list[int], max_tokens: int, kvtier: bool) -> dict:
    """One prompt after a prefix-cache reset: its tokens, their log-probabilities, vLLM's cached-token
    count and (with kvtier) that request's counter deltas."""
    from vllm import SamplingParams, TokensPrompt

    reset_ok = bool(llm.reset_prefix_cache())
    before = _kvtier_samples() if kvtier else {}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    gen = out.outputs[0]
    lps = [float(step[tok].logprob) for tok, step in zip(gen.token_ids, gen.logprobs or [])]
    sample: dict[str, Any] = {"tokens": list(gen.token_ids), "logprobs": lps, "cached": out.num_cached_tokens,
                              "reset_ok": reset_ok, "prompt_tokens": len(prompt), "s": round(seconds, 3)}
    if kvtier:
        after = _kvtier_samples()
        sample["kvtier"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    return sample


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=ROLES)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: {\"prompts\": [{\"ids\": [...]}, ...]}")
    ap.add_argument("--dir", required=True, help="the run's work directory (writers' SSD tiers under it)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shared", default=None, help="a reader's shared directory")
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args(argv)

    from kvtier.bench.ttft_engine import prepare_engine_process

    prepare_engine_process()
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    root, out = Path(a.dir), Path(a.out)
    cfg = role_config(a.role, root, Path(a.shared) if a.shared else None)
    prompts = [p["ids"] for p in json.loads(Path(a.prompts).read_text())["prompts"]]
    result: dict[str, Any] = {"role": a.role, "dtype": role_dtype(a.role), "pid": os.getpid(), "kvtier_config": cfg,
                              "outputs": [], "violations": [], "complete": False}

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)

    llm = make_llm(a.model, dtype=role_dtype(a.role), max_model_len=a.max_model_len,
                   kv_transfer_config=kv_transfer_config(cfg) if cfg is not None else None,
                   max_num_batched_tokens=a.max_batched, enable_prefix_caching=True)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    result["block_size"], result["chunk_size"] = block, CHUNK
    if CHUNK % block:
        raise SystemExit(f"kvtier chunk size {CHUNK} is not a multiple of the engine's block size {block}")
    t0 = time.perf_counter()
    writer = a.role.startswith("write-")
    for i, p in enumerate(prompts):
        s = serve(llm, p, 1 if writer else a.max_output_tokens, cfg is not None)
        if a.role.startswith("read-"):
            s["violations"] = _evidence(s, len(p), block)
            result["violations"] += [f"prompt {i}: {v}" for v in s["violations"]]
        result["outputs"].append(s)
        if i % 10 == 9:
            save()
    if writer and not _flush_kvtier():
        result["violations"].append("kvtier store flush timed out: chunks not durable")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["complete"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
