"""Cross-check kvtier's live-history client with vLLM's own multi-turn client (not in CI).

vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (source repository only, not the
wheel) sends the model's own answers back as the next turn's history. This driver runs it and
kvtier's client (``--history live``) on the same conversations against two servers, each client
on a fresh server of each configuration (vanilla vLLM; kvtier RAM+SSD), and prints both clients'
mean TTFT per server.

Conversations: seeded, user/assistant only (vLLM's client requires the first message to be a user
message, so no system prompt); a ~500-token document in the first user message, short follow-ups;
every reply exactly ``--reply-tokens`` tokens (vLLM's client: ``--limit-min-tokens/--limit-max-tokens``;
kvtier's: the same ``min_tokens``/``max_tokens`` fields, ``ignore_eos`` off). Both clients: N users
with one conversation each at a time, no think time (vLLM: ``-p N``, ``--no-early-stop``; kvtier:
closed loop, concurrency N, think times 0).

Usage (vLLM's script and its ``bench_dataset.py``/``bench_utils.py`` in VLLM_DIR, never committed here):
    python benchmarks/multi_turn_crosscheck/run.py --vllm-dir /tmp/vllm-mt --out /tmp/crosscheck
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvtier.bench.client import ClientOptions
from kvtier.bench.replay import ReplayOptions, replay_conversations
from kvtier.model import default_model_path
from kvtier.server import ServerSpec, VllmServer
from kvtier.workload.format import Conversation, Turn
from kvtier.workload.tokens import HFTokenizer

WORDS = ("cache memory latency token prefix server request disk vector model layer block tier store chunk query "
         "answer river mountain window garden music number letter history science ocean forest city market teacher "
         "engine planet winter summer signal bridge castle harbor lantern meadow").split()


def conversations(n: int, turns: int, doc_tokens: int, tok: HFTokenizer, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        doc = ""
        while len(tok.encode(doc)) < doc_tokens:
            doc += " " + " ".join(rng.choice(WORDS) for _ in range(20)) + "."
        msgs = [{"role": "user", "content": f"Document {i}:{doc}\nSummarize the document."},
                {"role": "assistant", "content": "(the model's answer)"}]
        for k in range(1, turns):
            msgs += [{"role": "user", "content": f"Question {k}: what does the document say about "
                                                 f"{rng.choice(WORDS)} and {rng.choice(WORDS)}?"},
                     {"role": "assistant", "content": "(the model's answer)"}]
        out.append(msgs)
    return out


def as_workload(convs: list[list[dict[str, str]]], reply_tokens: int) -> list[Conversation]:
    return [Conversation(id=f"CONV_{i}", turns=[Turn(user=m["content"], max_tokens=reply_tokens)
                                                  for m in msgs if m["role"] == "user"])
            for i, msgs in enumerate(convs)]


def run_vllm_client(vllm_dir: Path, conv_file: Path, url: str, model: str, served: str, users: int,
                    reply_tokens: int, raw: Path, log: Path) -> list[dict]:
    cmd = [sys.executable, str(vllm_dir / "benchmark_serving_multi_turn.py"), "-i", str(conv_file), "-m", model,
           "--served-model-name", served, "-u", url, "-p", str(users), "--no-early-stop",
           "--limit-min-tokens", str(reply_tokens), "--limit-max-tokens", str(reply_tokens),
           "--request-timeout-sec", "600", "--raw-json", str(raw)]
    print("vLLM client:", " ".join(cmd), flush=True)
    with log.open("w") as fh:
        subprocess.run(cmd, cwd=vllm_dir, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=900)
    return json.loads(raw.read_text())


def run_kvtier_client(convs: list[Conversation], url: str, users: int, reply_tokens: int) -> list:
    opts = ReplayOptions(mode="closed", concurrency=users, think_time_scale=0.0, history="live", progress=False,
                         client=ClientOptions(ignore_eos=False, extra_body=(("min_tokens", reply_tokens),
                                                                            ("max_tokens", reply_tokens))))
    return asyncio.run(replay_conversations(convs, url, opts)).records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=500)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    model = str(default_model_path())
    tok = HFTokenizer.open(model)
    msgs = conversations(a.conversations, a.turns, a.doc_tokens, tok, seed=1)
    conv_file = a.out / "conversations.json"
    conv_file.write_text(json.dumps([{"id": f"CONV_{i}", "messages": m} for i, m in enumerate(msgs)], indent=1))
    wl = as_workload(msgs, a.reply_tokens)
    plan = [("vanilla", "vllm"), ("vanilla", "kvtier"), ("kvtier-ram-ssd", "kvtier"), ("kvtier-ram-ssd", "vllm")]
    results: dict[str, dict[str, dict]] = {}
    for server_name, client in plan:
        kv = None
        if server_name != "vanilla":             # a fresh, empty SSD tier for each run
            kv = {"store": {"chunk_size": 128, "memory": {"capacity": 256 * 2**20},
                            "disk": {"enabled": True, "path": tempfile.mkdtemp(prefix="ssd-", dir=a.out),
                                     "capacity": 2 * 2**30}}}
        spec = ServerSpec(name=f"{server_name}-{client}", model=model, max_model_len=4096,
                          kv_cache_space_gib=a.kv_cache_gib, kvtier_config=kv)
        t0 = time.time()
        with VllmServer.start(spec, a.out / f"{spec.name}.server.log") as srv:
            served = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
            if client == "vllm":
                rows = run_vllm_client(a.vllm_dir, conv_file, srv.base_url, model, served, a.users, a.reply_tokens,
                                       a.out / f"{spec.name}.raw.json", a.out / f"{spec.name}.client.log")
                ttft = [r["ttft_ms"] / 1000 for r in rows]
                extra = {"output_tokens_mean": statistics.mean(r["output_num_tokens"] for r in rows)}
            else:
                recs = run_kvtier_client(wl, srv.base_url, a.users, a.reply_tokens)
                (a.out / f"{spec.name}.requests.jsonl").write_text("".join(r.to_json() + "\n" for r in recs))
                ok = [r for r in recs if r.ok]
                ttft = [r.ttft_s for r in ok]
                extra = {"output_tokens_mean": statistics.mean(r.output_tokens or 0 for r in ok),
                         "token_hit_rate": sum(r.cached_tokens or 0 for r in ok) / max(1, sum(r.prompt_tokens or 0
                                                                                            for r in ok)),
                         "failed": len(recs) - len(ok)}
        results.setdefault(server_name, {})[client] = {"requests": len(ttft), "ttft_mean_s": statistics.mean(ttft),
                                                       "ttft_p50_s": statistics.median(ttft),
                                                       "wall_s": time.time() - t0, **extra}
        print(server_name, client, json.dumps(results[server_name][client]), flush=True)
    for server_name, r in results.items():
        v, k = r["vllm"]["ttft_mean_s"], r["kvtier"]["ttft_mean_s"]
        r["kvtier_over_vllm_client"] = k / v
        print(f"{server_name}: mean TTFT vLLM client {v:.3f} s, kvtier client {k:.3f} s, ratio {k / v:.3f}")
    (a.out / "crosscheck.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                       "results": results}, indent=1))


if __name__ == "__main__":
    main()
