"""Decode-time KV vs a fresh prefill of the same tokens, per layer (float32), and what it does to
the next turn's output.

    timeout 600 .venv/bin/python benchmarks/chat/decode_kv_diff.py \
        [--prompt-tokens 200] [--gen-tokens 330] [--answer-tokens 32] [--json OUT] [--from DIR]

Runs ``tests/integration/save_generated_driver.py`` twice at once (one core each): ``kvtier``
saves the chunks of turn 1's prompt + generated tokens during decode (``save_generated``), then
turn 2 (turn-1 ids + generated ids + a question) loads them; ``reference`` computes turn 2 from
scratch (one prefill) and saves those chunks. Both dump the chunks' payloads; this script
compares them token position by token position:

  per layer, max |K_decode - K_prefill| and max |V ...| over the prompt positions (both sides
  prefilled, but in prefills of different lengths) and over the generated positions (one token
  per decode step vs one prefill), next to max |K| and max |V| for scale;
  turn 2's output with the hit vs without: greedy ids equal?, max |logprob difference| over the
  top-k of every generated token.

CPU: report it (AMD EPYC AVX2, 2 vCPU here); timing does not enter these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "integration" / "save_generated_driver.py"


def _run(role: str, model: str, d: Path, cpu: int, args: argparse.Namespace) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(DRIVER), role, "--model", model, "--out", str(d / f"{role}.json"),
           "--log", str(d / f"{role}.jsonl"), "--dump", str(d / f"{role}-kv"), "--prompt-tokens",
           str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--answer-tokens", str(args.answer_tokens)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(d / f"{role}.stderr", "w"))


def per_token_kv(payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CPU layout chunk payload [L, blocks, heads, block_size, 2*head] -> K, V as [L, tokens, heads, head].

    vLLM's CPU attention stores per (block, head) all keys then all values (a [2, block_size,
    head] view of the same bytes)."""
    L, nb, h, b, d2 = payload.shape
    kv = payload.reshape(L, nb, h, 2, b, d2 // 2)
    k = kv[:, :, :, 0].transpose(0, 1, 3, 2, 4).reshape(L, nb * b, h, d2 // 2)
    v = kv[:, :, :, 1].transpose(0, 1, 3, 2, 4).reshape(L, nb * b, h, d2 // 2)
    return k, v


def compare(decode_dumps: list[str], prefill_dumps: list[str], prompt_tokens: int) -> list[dict]:
    ks, vs = zip(*(per_token_kv(np.load(p)) for p in decode_dumps))
    rk, rv = zip(*(per_token_kv(np.load(p)) for p in prefill_dumps))
    k, v, rk, rv = (np.concatenate(x, axis=1) for x in (ks, vs, rk, rv))
    rows = []
    for layer in range(k.shape[0]):
        dk, dv = np.abs(k[layer] - rk[layer]), np.abs(v[layer] - rv[layer])
        p = slice(0, prompt_tokens)
        g = slice(prompt_tokens, k.shape[1])
        rows.append({"layer": layer, "k_prompt": float(dk[p].max()), "k_generated": float(dk[g].max()),
                     "v_prompt": float(dv[p].max()), "v_generated": float(dv[g].max()),
                     "k_max": float(np.abs(rk[layer]).max()), "v_max": float(np.abs(rv[layer]).max()),
                     "k_generated_rel": float(dk[g].max() / max(1e-30, np.abs(rk[layer][g]).max()))})
    return rows


def output_diff(got: dict, want: dict) -> dict:
    worst = 0.0
    for a, b in zip(got["topk"], want["topk"]):
        da, db = dict(map(tuple, a)), dict(map(tuple, b))
        for t in da.keys() & db.keys():
            worst = max(worst, abs(da[t] - db[t]))
    same = got["ids"] == want["ids"]
    return {"ids_equal": same, "tokens": len(got["ids"]), "max_logprob_diff": worst,
            "first_difference": None if same else next(i for i, (x, y) in enumerate(zip(got["ids"], want["ids"]))
                                                     if x != y)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--gen-tokens", type=int, default=330)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--from", dest="from_dir", help="compare the outputs of an earlier run of both drivers in this "
                    "directory (e.g. test_save_generated.py's tmp dir) instead of running them")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from kvtier.model import ensure_model

    with tempfile.TemporaryDirectory(prefix="kvtier-kvdiff-") as tmp:
        d = Path(args.from_dir or tmp)
        if not args.from_dir:
            model = str(ensure_model())
            procs = {r: _run(r, model, d, i % max(1, os.cpu_count() or 1), args)
                     for i, r in enumerate(("kvtier", "reference"))}
            for role, p in procs.items():
                if p.wait(timeout=580) != 0:
                    print(f"{role} driver failed:\n" + (d / f"{role}.stderr").read_text(errors="replace")[-3000:])
                    return 1
        kv, ref = (json.loads((d / f"{r}.json").read_text()) for r in ("kvtier", "reference"))
        t2 = kv["turn2"]
        claimed = sum(e.get("claimed_tokens", 0) for e in t2["log"] if e["event"] == "claim")
        rows = compare(kv["dumps"], ref["dumps"], kv["geometry"]["prompt_tokens"])
        out = {"geometry": kv["geometry"], "turn2_claimed_tokens": claimed,
               "turn2_num_cached_tokens": t2["requests"][0]["num_cached_tokens"],
               "turn1_ids_equal": kv["turn1"]["requests"][0]["ids"] == ref["turn1"]["requests"][0]["ids"],
               "output": output_diff(t2["requests"][0], ref["turn2"]["requests"][0]), "layers": rows}
    print(f"geometry {out['geometry']}; turn 2 claimed {claimed} tokens (vLLM cached {out['turn2_num_cached_tokens']})")
    print("layer  maxabs K prompt  K generated  V prompt   V generated  | max|K|   max|V|")
    for r in rows:
        print(f"{r['layer']:5d}  {r['k_prompt']:.3e}     {r['k_generated']:.3e}    {r['v_prompt']:.3e}  "
              f"{r['v_generated']:.3e}    | {r['k_max']:.2f}  {r['v_max']:.2f}")
    worst = {k: max(r[k] for r in rows) for k in ("k_prompt", "k_generated", "v_prompt", "v_generated")}
    print(f"worst over layers: {worst}")
    print(f"turn 2 with the hit vs without: {out['output']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
