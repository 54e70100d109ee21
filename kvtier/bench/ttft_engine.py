"""Engine side of ``kvtier bench ttft``: one configuration per subprocess
(``python -m kvtier.bench.ttft_engine ROLE ...``), so environments never mix.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the same for every role)
so kvtier's store and counters are readable here. TTFT = wall time of
``llm.generate(prompt, max_tokens=1)``. Roles:

  vanilla    no connector: cold, then the same prompt again = vLLM's prefix-cache hit
  kvtier-w   kvtier, empty cache: cold (miss); then the store's flush (every chunk durable on
             the SSD path), vLLM's prefix cache reset, the prompt again = kvtier RAM hit
  kvtier-r   a NEW engine on the same SSD directory, chunk files evicted from the page cache
             before each prompt = kvtier SSD hit
  shared-r:KIND  a NEW engine with empty local tiers (fresh RAM, no SSD) and the shared tier
             ``--shared`` (its chunks were put there from kvtier-w's SSD directory:
             ``shared_seed``); ``--evict`` paths leave the page cache before each prompt
             = kvtier shared-tier hit ("another machine")
  example-w/r  vLLM's ExampleConnector (safetensors per layer): writer, then a new reader engine
  peer:NAME  another connector tried for real in one engine: cold, prefix cache reset, hit
             (``PEERS``); a start-up failure is recorded by the orchestrator with its error line

Every hit row carries its evidence (``ttft_check``): vLLM's ``num_cached_tokens``, whether the
prefix-cache reset succeeded and, for kvtier, the counter deltas of that request. A row whose
evidence does not prove the label is written with ``violations`` and the run fails loudly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

CHUNK = 256                # kvtier chunk size in tokens (a multiple of the engine's block size, checked)

PEERS: dict[str, dict[str, Any]] = {
    "SimpleCPUOffloadConnector": {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}},
    "OffloadingConnector": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}},
    "LMCacheConnectorV1": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
}
SHARED_KINDS = ("sharedfs", "valkey", "mooncake")
SHARED_ROLES = tuple(f"shared-r:{k}" for k in SHARED_KINDS)
ROLES = ("vanilla", "kvtier-w", "kvtier-r", "example-w", "example-r") + SHARED_ROLES + \
    tuple(f"peer:{p}" for p in PEERS)
DIAG_TAG = "diag"          # --diag: extra prompts per hit role, timed under cProfile, not in the rows
DIAG_LENGTH = 1024         # their length (fixed: a writer and its readers may run different --lengths)


def bench_prompts(tok, length: int, repeats: int, tag: str = "") -> list[list[int]]:
    """``repeats`` prompts of exactly ``length`` tokens: seeded random sentences over kvtier's
    vocabulary (no repeated paragraph), distinct per (tag, length, repeat)."""
    from kvtier.workload import vocab

    pool = sorted({w for n in dir(vocab) if n.isupper() for w in getattr(vocab, n) if isinstance(w, str)})
    out = []
    for r in range(repeats):
        rng = random.Random(f"ttft-{tag}-{length}-{r}")
        ids: list[int] = []
        while len(ids) < length:
            words = " ".join(rng.choice(pool) for _ in range(rng.randint(6, 14)))
            ids += tok.encode(" " + words.capitalize() + ".", add_special_tokens=False)
        out.append(ids[:length])
    return out


def kvtier_bench_config(disk: Path | str) -> dict:
    """The kvtier config of the kvtier engines (everything else at its default)."""
    return {"store": {"chunk_size": CHUNK, "memory": {"capacity": "4GiB"},
                      "disk": {"enabled": True, "path": str(disk), "capacity": "16GiB"}}}


def shared_reader_config(shared: dict) -> dict:
    """The kvtier config of a shared-tier reader: fresh RAM, no SSD, the shared backend (bench
    deadlines: a slow 2-core machine must not turn a hit into a timeout)."""
    from kvtier.bench.shared_seed import reader_config

    return {"store": {"chunk_size": CHUNK, "memory": {"capacity": "4GiB"}, "disk": {"enabled": False},
                      "shared": reader_config(shared)}, "connector": {"load_timeout_s": 120.0}}


def parse_repeats(text: str, lengths: list[int]) -> dict[int, int]:
    """``"3"`` (every length) or ``"3,2,1"`` (one per length) -> {length: repeats}."""
    xs = [int(x) for x in str(text).split(",") if x.strip()]
    if len(xs) == 1:
        xs = xs * len(lengths)
    if len(xs) != len(lengths) or min(xs) < 1:
        raise ValueError(f"--repeats {text!r}: one count >= 1, or one per length ({len(lengths)})")
    return dict(zip(lengths, xs))


def evict_page_cache(root: Path) -> int:
    """fsync + posix_fadvise(DONTNEED) every file under ``root``; returns the bytes evicted."""
    total = 0
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            total += os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total


def _flush_kvtier(timeout: float = 120.0) -> bool:
    """Wait until this process's kvtier stores say every queued write is on the SSD path."""
    from kvtier import store

    return all(s.flush(timeout) for s in list(store._registry.values()))


def _kvtier_samples() -> dict[str, float]:
    from kvtier.integrations.vllm.metrics import kvtier_samples

    return {k: v for k, v in kvtier_samples().items() if "_bucket" not in k}


class Engine:
    def __init__(self, llm, kvtier: bool):
        self.llm, self.kvtier = llm, kvtier

    def timed(self, prompt: list[int], reset: bool, profile: bool = False) -> dict:
        """One TTFT sample with its evidence (``profile``: under cProfile, for a diagnosis only)."""
        from vllm import SamplingParams, TokensPrompt

        reset_ok = bool(self.llm.reset_prefix_cache()) if reset else None
        before = _kvtier_samples() if self.kvtier else {}
        sp = SamplingParams(temperature=0.0, max_tokens=1)
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        sample = {"s": dt, "cached": out[0].num_cached_tokens, "reset_ok": reset_ok}
        if prof is not None:
            prof.disable()
            sample["profile"] = _profile_text(prof)
        if self.kvtier:
            after = _kvtier_samples()
            sample["kvtier"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        return sample


def _profile_text(prof) -> str:
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(20)
    return buf.getvalue()


def _connector(role: str, root: Path, shared: dict | None = None) -> dict | None:
    from kvtier.server import kv_transfer_config

    if role.startswith("shared-r:"):
        if shared is None:
            raise SystemExit(f"{role} needs --shared CONFIG_JSON")
        return kv_transfer_config(shared_reader_config(shared))
    if role.startswith("kvtier"):
        return kv_transfer_config(kvtier_bench_config(root / "kvtier"))
    if role.startswith("example"):
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(root / "example")}}
    if role.startswith("peer:"):
        return PEERS[role.split(":", 1)[1]]
    return None


def _check(role: str, row: dict, n: int, chunk: int, block: int) -> list[str]:
    from kvtier.bench.ttft_check import HitEvidence, expected_hit_tokens, verify_kvtier_hit, verify_prefix_cache_hit

    bad = []
    checks = (("ram_hit", "memory"), ("ssd_hit", "disk")) if role.startswith("kvtier") else ()
    if role.startswith("shared-r:"):
        checks = (("shared_hit", role.split(":", 1)[1]),)
    for label, tier in checks:
        for s in row.get(label, []):
            ev = HitEvidence(expected_hit_tokens(n, chunk, block), chunk, s["reset_ok"], s["cached"], s["kvtier"])
            bad += [f"{label} {n}: {v}" for v in verify_kvtier_hit(ev, tier)]
    for s in row.get("apc_hit", []):
        bad += [f"apc_hit {n}: {v}" for v in verify_prefix_cache_hit((n - 1) // block * block, s["cached"])]
    for s in row.get("cold", []):          # a cold row that hit any cache measured no recompute
        if s.get("cached"):
            bad.append(f"cold {n}: {s['cached']} tokens came from a cache; a cold row must compute every token")
    return bad


def _shared_hit(eng: Engine, prompt: list[int], evict: list[str]) -> dict:
    from kvtier.bench.shared_seed import evict as evict_paths

    evict_paths(evict)
    return eng.timed(prompt, reset=True)


def _diag(eng: Engine, role: str, tok, n: int, root: Path, evict: list[str], block: int) -> dict:
    """Extra prompts (``DIAG_TAG``) at length ``n``, not part of any row: the writer computes two
    (cold) and times a RAM hit plain and under cProfile; the SSD reader times a hit under cProfile,
    the same prompt again with its files in the page cache (the device read taken out) and the
    other prompt's hit plain; a shared reader times a hit under cProfile."""
    p0, p1 = bench_prompts(tok, n, 2, DIAG_TAG)
    out: dict[str, Any] = {"length": n}
    if role == "kvtier-w":
        out["cold"] = eng.timed(p0, reset=False)
        out["cold_2"] = eng.timed(p1, reset=False)
        _flush_kvtier()
        out["ram_hit_plain"] = eng.timed(p0, reset=True)      # the same hit without the profiler
        out["ram_hit"] = eng.timed(p0, reset=True, profile=True)
        label = "ram_hit"
    elif role == "kvtier-r":
        evict_page_cache(root / "kvtier")
        out["ssd_hit"] = eng.timed(p0, reset=True, profile=True)
        out["ssd_hit_warm"] = eng.timed(p0, reset=True)              # page cache warm: the device read is out
        evict_page_cache(root / "kvtier")
        out["ssd_hit_plain"] = eng.timed(p1, reset=True)             # evicted, no profiler
        label = "ssd_hit"
    else:
        from kvtier.bench.shared_seed import evict as evict_paths

        evict_paths(evict)
        out["shared_hit"] = eng.timed(p0, reset=True, profile=True)
        label = "shared_hit"
    out["violations"] = _check(role, {label: [out[label]]}, n, CHUNK, block)
    return out


def prepare_engine_process() -> None:
    """The environment of a bench engine process, set before vLLM is imported: 3 GiB of KV cache, the
    8K+ context of the bundled model allowed, the engine in this process (its timings are this process's)."""
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=3)
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=ROLES)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--repeats", default="3", help="N, or one count per length: 3,2,1")
    ap.add_argument("--shared", default=None, help="file holding the store.shared config (JSON) of a shared-r role")
    ap.add_argument("--evict", default="", help=f"paths ({os.pathsep}-separated) evicted before each shared hit")
    ap.add_argument("--diag", action="store_true", help="one more hit per hit role, under cProfile")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8448)
    a = ap.parse_args(argv)

    prepare_engine_process()
    from kvtier.engine import make_llm

    lengths = [int(x) for x in a.lengths.split(",")]
    repeats = parse_repeats(a.repeats, lengths)
    shared = json.loads(Path(a.shared).read_text()) if a.shared else None
    evict = [p for p in a.evict.split(os.pathsep) if p]
    root = Path(a.dir)
    result: dict[str, Any] = {"role": a.role, "pid": os.getpid(), "rows": {}, "violations": []}
    out = Path(a.out)

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)

    llm = make_llm(a.model, dtype=a.dtype, max_model_len=a.max_model_len, kv_transfer_config=_connector(a.role, root, shared),
                   max_num_batched_tokens=a.max_batched, enable_prefix_caching=True)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    result["block_size"], result["chunk_size"] = block, CHUNK
    if CHUNK % block:
        raise SystemExit(f"kvtier chunk size {CHUNK} is not a multiple of the engine's block size {block}")
    eng = Engine(llm, a.role.startswith(("kvtier", "shared-r:")))
    tok = llm.get_tokenizer()
    eng.timed(bench_prompts(tok, 64, 1, "warmup")[0], reset=False)   # first-call overheads out of the way
    for n in lengths:
        prompts = bench_prompts(tok, n, repeats[n])
        row: dict[str, Any] = {}
        result["rows"][str(n)] = row
        if a.role in ("vanilla", "kvtier-w", "example-w") or a.role.startswith("peer:"):
            row["cold"] = [eng.timed(p, reset=False) for p in prompts]
            save()
            if a.role == "vanilla":
                row["apc_hit"] = [eng.timed(p, reset=False) for p in prompts]
            elif a.role == "kvtier-w":
                if not _flush_kvtier():
                    result["violations"].append("kvtier store flush timed out: chunks not durable")
                row["ram_hit"] = [eng.timed(p, reset=True) for p in prompts]
            elif a.role.startswith("peer:"):
                row["hit"] = [eng.timed(p, reset=True) for p in prompts]
        elif a.role.startswith("shared-r:"):   # a new process, empty local tiers: "another machine"
            row["shared_hit"] = [_shared_hit(eng, p, evict) for p in prompts]
        else:  # readers: a new process; every load comes from files evicted from the page cache
            sub = root / ("kvtier" if a.role == "kvtier-r" else "example")
            times = []
            for p in prompts:
                evict_page_cache(sub)
                times.append(eng.timed(p, reset=True))
            row["ssd_hit"] = times
        result["violations"] += _check(a.role, row, n, CHUNK, block)
        save()
    if a.diag and a.role in ("kvtier-w", "kvtier-r") + SHARED_ROLES:
        result["diag"] = _diag(eng, a.role, tok, DIAG_LENGTH, root, evict, block)
        save()
    if a.role == "kvtier-w" and not _flush_kvtier():
        result["violations"].append("kvtier store flush timed out at exit")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
