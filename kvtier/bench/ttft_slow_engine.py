"""Engine side of ``kvtier bench ttft --slow-tier``: one configuration per subprocess
(``python -m kvtier.bench.ttft_slow_engine ROLE ...``), in-process engine as in ``ttft_engine``.

Roles:
  recompute:N    vanilla vLLM (no connector): the timed prompts cold = recompute (run twice, before
                 and after the readers, N = 1, 2: the baseline spans the readers' time)
  writer         kvtier with an SSD tier, empty: the timed prompts cold ("kvtier miss"), then the
                 probe prompt; every chunk flushed to the SSD (the orchestrator then puts them into
                 the shared directory, ``shared_seed``)
  slow:POLICY    a NEW engine, empty RAM, no SSD, the shared directory behind ``store.faults``
                 latency (``--latency-ms`` on every read and existence query), ``claims.policy`` POLICY
  fast:POLICY    the same without the latency (today's shared-tier hit, and that hit under POLICY)

Every engine first computes one prompt of its own, untimed (``teach``, tagged with the role: cold
everywhere; the first long prefill of an engine pays one-time costs, and in a reader the worker times
this forward pass: the prefill cost estimate). A reader then takes one shared-tier hit, untimed
(``probe``: the worker times the tier's reads; under ``pays-off`` nothing is declined before that, so
this one is loaded), then the timed prompts, each after vLLM's prefix-cache reset and with the shared
directory's page cache dropped, each preceded by a prompt of the reader's own, cold (``cold``: the
recompute of this engine at that moment, interleaved so that other work on the machine weighs on
both alike; under ``always`` with the slow tier it includes the tier's existence query, which
``pays-off`` skips once the tier is known slow). Readers save nothing (``connector.save: false``): the shared
directory stays as seeded for every reader, and a declined prompt is a plain recompute. Every
sample carries its evidence (vLLM's cached tokens, kvtier's counter deltas).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.ttft_engine import CHUNK, Engine, _flush_kvtier, bench_prompts, evict_page_cache, \
    kvtier_bench_config

POLICIES = ("always", "pays-off")
READERS = tuple(f"{s}:{p}" for s in ("slow", "fast") for p in POLICIES)
ROLES = ("recompute:1", "recompute:2", "writer") + READERS
TEACH_TAG, PROBE_TAG, COLD_TAG = "teach", "probe", "cold"


def reader_config(shared_dir: Path, policy: str, latency_ms: float) -> dict:
    """A reader's kvtier config: fresh RAM, no SSD, the shared directory (with the bench's deadlines,
    a 2-core machine must not turn a slow hit into a timeout), optionally slowed."""
    from kvtier.bench.shared_seed import reader_config as shared_reader

    store: dict[str, Any] = {"chunk_size": CHUNK, "memory": {"capacity": "4GiB"}, "disk": {"enabled": False},
                             "shared": shared_reader({"kind": "sharedfs", "path": str(shared_dir)})}
    if latency_ms > 0:
        store["faults"] = {"wraps": "shared", "latency_ms": latency_ms}
    return {"store": store, "connector": {"load_timeout_s": 120.0, "save": False}, "claims": {"policy": policy}}


def role_config(role: str, root: Path, latency_ms: float) -> dict | None:
    if role.startswith("recompute"):
        return None
    if role == "writer":
        return kvtier_bench_config(root / "kvtier")
    speed, policy = role.split(":", 1)
    return reader_config(root / "shared", policy, latency_ms if speed == "slow" else 0.0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=ROLES)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8448)
    a = ap.parse_args(argv)

    from kvtier.bench.ttft_engine import prepare_engine_process

    prepare_engine_process()
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    root, out = Path(a.dir), Path(a.out)
    cfg = role_config(a.role, root, a.latency_ms)
    result: dict[str, Any] = {"role": a.role, "pid": os.getpid(), "kvtier_config": cfg, "rows": {}}

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)

    llm = make_llm(a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                   kv_transfer_config=kv_transfer_config(cfg) if cfg is not None else None,
                   max_num_batched_tokens=a.max_batched, enable_prefix_caching=True)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    result["block_size"], result["chunk_size"] = block, CHUNK
    eng = Engine(llm, cfg is not None)
    tok = llm.get_tokenizer()
    eng.timed(bench_prompts(tok, 64, 1, "warmup")[0], reset=False)
    shared = root / "shared"
    for n in (int(x) for x in a.lengths.split(",")):
        prompts = bench_prompts(tok, n, a.repeats)
        row: dict[str, Any] = {}
        result["rows"][str(n)] = row
        row["teach"] = eng.timed(bench_prompts(tok, n, 1, f"{TEACH_TAG}-{a.role}")[0], reset=False)
        if a.role.startswith("recompute"):
            row["cold"] = [eng.timed(p, reset=True) for p in prompts]
        elif a.role == "writer":
            row["cold"] = [eng.timed(p, reset=False) for p in prompts]
            row["probe"] = eng.timed(bench_prompts(tok, n, 1, PROBE_TAG)[0], reset=False)
            if not _flush_kvtier():
                result.setdefault("violations", []).append("kvtier store flush timed out: chunks not durable")
        else:
            evict_page_cache(shared)
            row["probe"] = eng.timed(bench_prompts(tok, n, 1, PROBE_TAG)[0], reset=True)
            samples, cold = [], []
            for i, p in enumerate(prompts):      # interleaved: a prompt of its own, cold, then a hit
                cold.append(eng.timed(bench_prompts(tok, n, i + 1, f"{COLD_TAG}-{a.role}")[i], reset=True))
                evict_page_cache(shared)
                samples.append(eng.timed(p, reset=True))
            row["hit"], row["cold"] = samples, cold
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
