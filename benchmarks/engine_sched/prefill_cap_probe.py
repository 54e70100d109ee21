"""Does vLLM's ``long_prefill_token_threshold`` let a kvtier hit overtake a cold prefill?

    .venv/bin/python benchmarks/engine_sched/prefill_cap_probe.py --caps 0,256

One kvtier (RAM) server per cap, vLLM's own prefix cache off (every cached token comes from kvtier).
Per trial: a returning turn's history H (~900 tokens) is sent once (kvtier saves it); then a cold
prompt C (~1,500 tokens, another user's first turn) is sent, and 0.3 s later H + a new ~60-token
message. Prints each request's TTFT (streamed, 1 output token). Without a cap, the returning turn
waits for C's whole prefill (one engine step on the one compute core); with a cap of N tokens,
C advances N tokens a step and the returning turn joins the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = ("river stone light garden paper window music orange silver forest quiet morning table story "
         "bridge cloud winter summer market letter signal harbor valley candle meadow").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def ttft(client: httpx.AsyncClient, url: str, model: str, prompt: str, delay: float = 0.0) -> float:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


async def trials(url: str, model: str, n: int, seed: int) -> list[dict]:
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(n):
            rng = random.Random(seed * 1000 + t)
            hist, cold, new = text(rng, 900), text(rng, 1500), text(rng, 60)
            warm = await ttft(client, url, model, hist)                     # kvtier saves H
            c, h = await asyncio.gather(ttft(client, url, model, cold), ttft(client, url, model, hist + " " + new, 0.3))
            alone = await ttft(client, url, model, hist + " " + text(rng, 60))  # a hit with nothing beside it
            out.append({"first_send_s": round(warm, 3), "cold_s": round(c, 3), "returning_s": round(h, 3),
                        "returning_alone_s": round(alone, 3)})
            print(f"  trial {t}: cold {c:.2f} s, returning beside it {h:.2f} s, returning alone {alone:.2f} s",
                  flush=True)
    return out


def main() -> int:
    from kvtier.model import default_model_path
    from kvtier.server import ServerSpec, VllmServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,256", help="long_prefill_token_threshold values (0: vLLM's default, none)")
    ap.add_argument("--batched", default="", help="max_num_batched_tokens per cap, comma-separated ('' = vLLM's default)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    model = str(default_model_path())
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        caps = [int(x) for x in a.caps.split(",")]
        batched = [int(x) if x else None for x in a.batched.split(",")] if a.batched else [None] * len(caps)
        for cap, mnbt in zip(caps, batched, strict=True):
            kv = {"store": {"chunk_size": 128, "memory": {"capacity": 512 << 20}, "disk": {"enabled": False}}}
            extra = ("--long-prefill-token-threshold", str(cap)) if cap else ()
            spec = ServerSpec(name=f"cap{cap}", model=model, max_model_len=4096, kv_cache_space_gib=0.5,
                              max_num_batched_tokens=mnbt,
                              enable_prefix_caching=False, kvtier_config=kv, extra_args=extra)
            print(f"cap {cap}, max_num_batched_tokens {mnbt or 'default'}: starting server", flush=True)
            with VllmServer.start(spec, Path(tmp) / f"cap{cap}.log") as srv:
                rows = asyncio.run(trials(srv.base_url, model, a.trials, seed=1))
            label = f"cap {cap}, max_num_batched_tokens {mnbt or 'default'}"
            res[label] = {"max_num_batched_tokens": mnbt, "long_prefill_token_threshold": cap, "trials": rows,
                          "returning_median_s": statistics.median(r["returning_s"] for r in rows),
                          "cold_median_s": statistics.median(r["cold_s"] for r in rows)}
            print(f"{label}: returning beside a cold prefill, median {res[label]['returning_median_s']:.2f} s; "
                  f"cold {res[label]['cold_median_s']:.2f} s", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
