"""The same workload replayed against vanilla, kvtier RAM, vanilla, kvtier RAM, each on a fresh server
in that order, so that a difference between configurations can be told from the machine's drift.

    .venv/bin/python benchmarks/engine_sched/interleaved_replays.py RECORD [OUT]

RECORD: a companion demo's results folder (its ``workload.jsonl`` and ``demo.json``; the engine and
RAM sizes below are ``kvtier demo --quick``'s on the Intel AMX class, from its record). Prints per
replay the mean TTFT, the median and mean gap between tokens, and the token hit rate.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from kvtier.bench.compare import run_compare
from kvtier.demo.companion import QUICK
from kvtier.demo.live import replay_options
from kvtier.model import default_model_path
from kvtier.server import ServerSpec

KV_GIB = 0.02197265625          # the engine KV space of companion-quick/2026-12-06-amx/run-2
RAM = {"store": {"chunk_size": 128, "memory": {"capacity": 38_338_560}, "disk": {"enabled": False}}}


def main(record: Path, out: Path) -> None:
    demo = json.loads((record / "demo.json").read_text())
    size = dataclasses.replace(QUICK, **{k: v for k, v in demo["size"].items() if hasattr(QUICK, k)})
    common = dict(model=str(default_model_path()), max_model_len=784, dtype="bfloat16", kv_cache_space_gib=KV_GIB)
    specs = [ServerSpec(name="vanilla-1", **common), ServerSpec(name="ram-1", kvtier_config=RAM, **common),
             ServerSpec(name="vanilla-2", **common), ServerSpec(name="ram-2", kvtier_config=RAM, **common)]
    result = run_compare(record / "workload.jsonl", specs, out, replay_options(size, "live", 300))
    for run in result.runs:
        recs = [r for r in run.records if r.ttft_s is not None]
        gaps = [g for r in recs for g in (r.itl_s or [])]
        hit = sum(r.cached_tokens or 0 for r in recs) / max(1, sum(r.prompt_tokens for r in recs))
        print(f"{run.name}: TTFT mean {statistics.mean(r.ttft_s for r in recs):.2f} s, gap between tokens "
              f"median {1e3 * statistics.median(gaps):.1f} ms, mean {1e3 * statistics.mean(gaps):.1f} ms, "
              f"token hit rate {hit:.1%}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: interleaved_replays.py RECORD [OUT]")
    main(Path(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) == 3 else "interleaved-replays"))
