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

Beside each run it records what else could explain a difference: the load average before and
after, the CPU seconds of the client (the vLLM client's processes via ``RUSAGE_CHILDREN``; kvtier's
in-process client via ``time.process_time``), of the server's process group and of the whole
machine (``/proc/stat``), and the server's own view from ``/metrics`` (vLLM's TTFT, queue, prefill,
decode and e2e histograms, prefix-cache hits). ``--plan`` sets the runs and their order
(``server:client,...``) and ``--tag`` prefixes the file names, so repeats with the order swapped can
share one output folder; ``summarize.py`` pools them.

Usage (vLLM's script and its ``bench_dataset.py``/``bench_utils.py`` in VLLM_DIR, never committed here):
    python benchmarks/multi_turn_crosscheck/run.py --vllm-dir /tmp/vllm-mt --out /tmp/crosscheck \
        --plan vanilla:vllm,vanilla:kvtier --tag r1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client.stream import ClientOptions
from kvtier.client.replay import ReplayOptions, replay_conversations
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


SERVER_HISTS = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds", "vllm:inter_token_latency_seconds")
SERVER_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                   "vllm:external_prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
                   "vllm:num_preemptions")


def server_samples(url: str) -> dict[str, float]:
    """Histogram sums/counts and counters of interest, summed over label sets."""
    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            name = smp.name
            if name.endswith(("_created", "_bucket")):
                continue
            if (name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in SERVER_HISTS) or \
                    name.removesuffix("_total") in SERVER_COUNTERS:
                out[name] = out.get(name, 0.0) + float(smp.value)
    return out


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The server's own figures for the run: mean of each histogram, counter deltas."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    view: dict[str, float | None] = {}
    for h in SERVER_HISTS:
        n = d.get(h + "_count", 0.0)
        view[h.split(":", 1)[1] + "_mean"] = d.get(h + "_sum", 0.0) / n if n else None
        view[h.split(":", 1)[1] + "_count"] = n
    for c in SERVER_COUNTERS:
        view[c.split(":", 1)[1]] = d.get(c + "_total", d.get(c))
    return view


def machine_busy_s() -> tuple[float, float]:
    """(CPU seconds all cores spent not idle, of which stolen by the hypervisor), ``/proc/stat``, since boot."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + f[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(f[:8]) - idle) / tick, f[7] / tick


def proc_cpu() -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, process group, user+system CPU seconds) of every live process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # fields from 3 (state) on
        out[int(d.name)] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[2]),
                            (int(fields[11]) + int(fields[12])) / tick)
    return out


def group_cpu_s(procs: dict[int, tuple[str, int, float]], pgid: int) -> float:
    """CPU seconds of the live processes of one process group (the server)."""
    return sum(cpu for _, g, cpu in procs.values() if g == pgid)


def others_cpu(before: dict, after: dict, skip_pgids: set[int], skip_pids: set[int], top: int = 6) -> list:
    """The processes outside the server and the client that used the most CPU during the run (processes
    that started or ended within it count with what /proc showed)."""
    rows = []
    for pid, (comm, pgid, cpu) in after.items():
        if pgid in skip_pgids or pid in skip_pids:
            continue
        d = cpu - (before[pid][2] if pid in before else 0.0)
        if d > 0:
            rows.append((round(d, 2), pid, comm))
    return sorted(rows, reverse=True)[:top]


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def run_vllm_client(vllm_dir: Path, conv_file: Path, url: str, model: str, served: str, users: int,
                    reply_tokens: int, raw: Path, answers: Path, log: Path, pythonpath: str | None) -> list[dict]:
    cmd = [sys.executable, str(vllm_dir / "benchmark_serving_multi_turn.py"), "-i", str(conv_file), "-m", model,
           "--served-model-name", served, "-u", url, "-p", str(users), "--no-early-stop",
           "--limit-min-tokens", str(reply_tokens), "--limit-max-tokens", str(reply_tokens),
           "--request-timeout-sec", "600", "-o", str(answers), "--raw-json", str(raw)]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    print("vLLM client:", (f"PYTHONPATH={pythonpath} " if pythonpath else "") + " ".join(cmd), flush=True)
    with log.open("w") as fh:
        subprocess.run(cmd, cwd=vllm_dir, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=900, env=env)
    return json.loads(raw.read_text())


def run_kvtier_client(convs: list[Conversation], url: str, users: int, reply_tokens: int) -> list:
    opts = ReplayOptions(mode="closed", concurrency=users, think_time_scale=0.0, history="live", progress=False,
                         client=ClientOptions(ignore_eos=False, extra_body=(("min_tokens", reply_tokens),
                                                                            ("max_tokens", reply_tokens))))
    return asyncio.run(replay_conversations(convs, url, opts)).records


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None


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
    ap.add_argument("--plan", default="vanilla:vllm,vanilla:kvtier,kvtier-ram-ssd:kvtier,kvtier-ram-ssd:vllm",
                    help="runs in order, server:client (server: vanilla | kvtier-ram-ssd; client: vllm | kvtier)")
    ap.add_argument("--tag", default="", help="prefix of this invocation's file names (e.g. r1)")
    ap.add_argument("--kvtier-only-cache", action="store_true",
                    help="the kvtier server runs with vLLM's own prefix cache off: every cached token comes from kvtier")
    ap.add_argument("--client-pythonpath", default=None,
                    help="extra PYTHONPATH for vLLM's client only (e.g. where pandas was installed)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    plan = [tuple(x.split(":")) for x in a.plan.split(",")]
    for server_name, client in plan:
        if server_name not in ("vanilla", "kvtier-ram-ssd") or client not in ("vllm", "kvtier"):
            ap.error(f"bad plan entry {server_name}:{client}")
    prefix = f"{a.tag}-" if a.tag else ""
    model = str(default_model_path())
    tok = HFTokenizer.open(model)
    msgs = conversations(a.conversations, a.turns, a.doc_tokens, tok, seed=1)
    conv_file = a.out / "conversations.json"
    conv_file.write_text(json.dumps([{"id": f"CONV_{i}", "messages": m} for i, m in enumerate(msgs)], indent=1))
    wl = as_workload(msgs, a.reply_tokens)
    results: list[dict] = []
    for order, (server_name, client) in enumerate(plan):
        kv = None
        if server_name != "vanilla":             # a fresh, empty SSD tier for each run
            kv = {"store": {"chunk_size": 128, "memory": {"capacity": 256 * 2**20},
                            "disk": {"enabled": True, "path": tempfile.mkdtemp(prefix="ssd-", dir=a.out),
                                     "capacity": 2 * 2**30}}}
        spec = ServerSpec(name=f"{prefix}{server_name}-{client}", model=model, max_model_len=4096,
                          kv_cache_space_gib=a.kv_cache_gib, kvtier_config=kv,
                          enable_prefix_caching=not (kv is not None and a.kvtier_only_cache))
        t_start = time.time()
        with VllmServer.start(spec, a.out / f"{spec.name}.server.log") as srv:
            started_s = time.time() - t_start
            served = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
            m0, load0 = server_samples(srv.base_url), loadavg()
            busy0, procs0, t0 = machine_busy_s(), proc_cpu(), time.perf_counter()
            ru0, pt0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
            if client == "vllm":
                rows = run_vllm_client(a.vllm_dir, conv_file, srv.base_url, model, served, a.users, a.reply_tokens,
                                       a.out / f"{spec.name}.raw.json", a.out / f"{spec.name}.answers.json",
                                       a.out / f"{spec.name}.client.log", a.client_pythonpath)
            else:
                recs = run_kvtier_client(wl, srv.base_url, a.users, a.reply_tokens)
            wall = time.perf_counter() - t0
            ru1, pt1 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
            (busy, steal), procs1 = machine_busy_s(), proc_cpu()
            busy, steal = busy - busy0[0], steal - busy0[1]
            srv_cpu = group_cpu_s(procs1, srv.process.pid) - group_cpu_s(procs0, srv.process.pid)
            beside = others_cpu(procs0, procs1, {srv.process.pid}, {os.getpid()})
            load1, m1 = loadavg(), server_samples(srv.base_url)
        if client == "vllm":
            # (input_num_turns - 1) / 2 is the turn's index: messages sent = 2k + 1
            reqs = [{"conversation_id": r["conversation_id"], "turn": (r["input_num_turns"] - 1) // 2,
                     "ttft_s": r["ttft_ms"] / 1000, "e2e_s": r["latency_ms"] / 1000,
                     "output_tokens": r["output_num_tokens"]} for r in rows]
            client_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
            failed = 0
        else:
            (a.out / f"{spec.name}.requests.jsonl").write_text("".join(r.to_json() + "\n" for r in recs))
            reqs = [{"conversation_id": r.conversation_id, "turn": r.turn, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                     "output_tokens": r.output_tokens} for r in recs if r.ok]
            client_cpu = pt1 - pt0
            failed = len(recs) - len(reqs)
        ttft = [r["ttft_s"] for r in reqs]
        turns = sorted({r["turn"] for r in reqs})
        res = {"tag": a.tag, "order": order, "server": server_name, "client": client, "requests": len(reqs),
               "failed": failed, "ttft_mean_s": _mean(ttft), "ttft_p50_s": statistics.median(ttft),
               "ttft_turn_mean_s": [_mean([r["ttft_s"] for r in reqs if r["turn"] == t]) for t in turns],
               "e2e_mean_s": _mean([r["e2e_s"] for r in reqs]),
               "decode_mean_s": _mean([r["e2e_s"] - r["ttft_s"] for r in reqs]),
               "output_tokens_mean": _mean([r["output_tokens"] or 0 for r in reqs]),
               "run_s": wall, "server_start_s": started_s, "loadavg_before": load0, "loadavg_after": load1,
               "cpu_s": {"client": client_cpu, "server": srv_cpu, "machine": busy,
                         "other": busy - srv_cpu - client_cpu, "steal": steal, "other_top": beside},
               "server_view": server_view(m0, m1), "per_request": reqs}
        results.append(res)
        (a.out / f"{spec.name}.summary.json").write_text(json.dumps(res, indent=1))
        print(server_name, client, json.dumps({k: v for k, v in res.items() if k != "per_request"}), flush=True)
    (a.out / f"{prefix}crosscheck.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                                "results": results}, indent=1))


if __name__ == "__main__":
    main()
