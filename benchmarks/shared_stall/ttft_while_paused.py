"""Other requests' TTFT while the shared backend is paused.

    timeout 600 .venv/bin/python benchmarks/shared_stall/ttft_while_paused.py \
        --juicefs [--others 8] [--doc-tokens 4096] [--json OUT.json]
    ... --shared DIR --pause-pid PID        # your own mount: SIGSTOP that process (and its children)

With ``--juicefs`` a JuiceFS volume is started here (tests/services: metadata in Valkey, data in
a local directory) and mounted twice: a writer server ("machine A", mount a) computes two long
documents D_paused and D_hit and writes their KV through to the ``sharedfs`` tier; then ONE
measured server ("machine B", mount b, its own empty RAM, no SSD) serves three phases, each =
one long document + ``--others`` short distinct prompts (misses) sent at a steady pace:

* **hit**    — D_hit, backend running: the document loads from the shared tier;
* **miss**   — D_miss (never stored), backend running: the document is recomputed;
* **paused** — D_paused (stored), backend paused: SIGSTOP of mount b's ``juicefs`` processes for
  the whole phase (every file operation on the mount then blocks in the kernel), SIGCONT after.

The claim measured: a stalled backend costs the other requests nothing beyond the lost hit —
the "paused" phase's other-request TTFT should match the "miss" phase's (same work: a recompute
of a long document beside the short prompts), not exceed it (which would mean the engine waited
on the mount). D_paused's own TTFT shows how long the stall held it (lookup deadline
``--lookup-timeout-s``, then recompute; or a load that times out at ``--load-timeout-s``).
Printed: p50 / p90 / max of the other requests per phase, ratios paused/miss and paused/hit,
the documents' TTFT, the kvtier events the measured server logged. Report the CPU and that
other jobs may have run beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
sys.path.insert(0, str(ROOT / "benchmarks" / "sharedfs"))

from kvtier.server import ServerSpec, VllmServer  # noqa: E402

CHUNK = 256


def kvtier_cfg(shared: Path, memory: bool, a: argparse.Namespace) -> dict:
    return {"store": {"chunk_size": CHUNK, "memory": {"enabled": memory, "capacity": "1GiB"},
                      "disk": {"enabled": False},
                      "shared": {"kind": "sharedfs", "path": str(shared), "create": True, "janitor": False,
                                 "lookup_timeout_s": a.lookup_timeout_s, "io_timeout_s": a.io_timeout_s,
                                 "probe_interval_s": 1.0}},
            "connector": {"load_timeout_s": a.load_timeout_s}}


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
        await asyncio.sleep(0.2)                    # the document is asked first
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


@contextlib.contextmanager
def backend(a: argparse.Namespace, tmp: Path):
    """(writer dir, reader dir, pause(), resume())."""
    if a.juicefs:
        from common import juicefs_volume

        with juicefs_volume(tmp / "jfs") as (fs, _meta):
            ma, mb = fs.mount("a"), fs.mount("b")
            (ma.path / "kv").mkdir()
            while not (mb.path / "kv").is_dir():
                time.sleep(0.05)
            yield ma.path / "kv", mb.path / "kv", mb.pause, mb.resume
        return
    yield a.shared, a.shared, lambda: os.kill(a.pause_pid, signal.SIGSTOP), lambda: os.kill(a.pause_pid, signal.SIGCONT)


def kvtier_events(log: Path) -> list[str]:
    keys = ("unavailable", "timeout", "timed out", "breaker", "shared_down", "recompute")
    try:
        return [line.strip()[:240] for line in log.read_text(errors="replace").splitlines()
                if "kvtier" in line and any(k in line for k in keys)][:20]
    except OSError:
        return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--juicefs", action="store_true", help="start a two-mount JuiceFS volume here")
    ap.add_argument("--shared", type=Path, default=None, help="directory on your shared mount (with --pause-pid)")
    ap.add_argument("--pause-pid", type=int, default=None, help="SIGSTOP this process during the paused phase")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--others", type=int, default=8)
    ap.add_argument("--other-tokens", type=int, default=300)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--gap-s", type=float, default=0.5, help="seconds between the other requests")
    ap.add_argument("--lookup-timeout-s", type=float, default=0.5)
    ap.add_argument("--io-timeout-s", type=float, default=3.0)
    ap.add_argument("--load-timeout-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if not a.juicefs and (a.shared is None or a.pause_pid is None):
        print("error: give --juicefs, or --shared DIR with --pause-pid PID", file=sys.stderr)
        return 2
    if a.pause_pid is not None:
        try:
            os.kill(a.pause_pid, 0)
        except OSError as e:
            print(f"error: --pause-pid {a.pause_pid}: {e}", file=sys.stderr)
            return 2
    from kvtier.model import ensure_model

    model = a.model or str(ensure_model())
    logs = Path(tempfile.mkdtemp(prefix="kvtier-stall-"))
    docs = {"hit": tokens(1, a.doc_tokens), "miss": tokens(2, a.doc_tokens), "paused": tokens(3, a.doc_tokens)}
    others = {ph: [tokens(100 * (i + 1) + j, a.other_tokens) for j in range(a.others)]
              for i, ph in enumerate(docs)}
    result: dict = {"mode": "juicefs mount b SIGSTOP" if a.juicefs else f"SIGSTOP pid {a.pause_pid}",
                    "cpu_count": os.cpu_count(), "args": {k: str(v) for k, v in vars(a).items()}}
    with tempfile.TemporaryDirectory(prefix="kvtier-stall-vol-") as tmp, \
            backend(a, Path(tmp)) as (wdir, rdir, pause, resume):
        t0 = time.time()
        with serve("writer", model, kvtier_cfg(wdir, False, a), logs) as w:
            for ph in ("hit", "paused"):
                asyncio.run(phase(w.base_url, model, [], docs[ph], 0))
            want = 2 * (a.doc_tokens // CHUNK)
            deadline = time.time() + 120
            while len(list(wdir.rglob("*.kvc"))) < want and time.time() < deadline:
                time.sleep(0.5)
            result["stored_chunks"] = len(list(wdir.rglob("*.kvc")))
        result["writer_s"] = round(time.time() - t0, 1)
        with serve("measured", model, kvtier_cfg(rdir, True, a), logs) as m:
            asyncio.run(phase(m.base_url, model, [tokens(999, a.other_tokens)], None, 0))     # warm-up
            for ph in ("hit", "miss"):
                result[ph] = asyncio.run(phase(m.base_url, model, others[ph], docs[ph], a.gap_s))
            pause()
            t_pause = time.perf_counter()
            try:
                result["paused"] = asyncio.run(phase(m.base_url, model, others["paused"], docs["paused"], a.gap_s))
            finally:
                resume()
                result["paused_for_s"] = round(time.perf_counter() - t_pause, 1)
            result["after_resume"] = asyncio.run(phase(m.base_url, model, [tokens(777, a.other_tokens)], None, 0))
        result["kvtier_events"] = kvtier_events(logs / "measured.log")
    st = {ph: stats(result[ph]["others_ttft_s"]) for ph in ("hit", "miss", "paused")}
    result["others"] = {**st, "paused_vs_miss_p50": st["paused"]["p50"] / st["miss"]["p50"],
                        "paused_vs_miss_p90": st["paused"]["p90"] / st["miss"]["p90"],
                        "paused_vs_hit_p50": st["paused"]["p50"] / st["hit"]["p50"]}
    print(f"mode: {result['mode']}  (logs in {logs}); {result['stored_chunks']} chunks stored by the writer")
    for ph in ("hit", "miss", "paused"):
        s = st[ph]
        print(f"  {ph:6s}: other requests TTFT p50 {s['p50']:.3f} s p90 {s['p90']:.3f} s max {s['max']:.3f} s | "
              f"document {result[ph]['doc_ttft_s']:.3f} s")
    o = result["others"]
    print(f"  paused / miss: p50 {o['paused_vs_miss_p50']:.2f}x p90 {o['paused_vs_miss_p90']:.2f}x; "
          f"paused / hit: p50 {o['paused_vs_hit_p50']:.2f}x; backend paused {result['paused_for_s']} s; "
          f"after resume a request took {result['after_resume']['others_ttft_s'][0]:.3f} s")
    for e in result["kvtier_events"]:
        print("  event:", e)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
