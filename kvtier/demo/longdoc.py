"""``kvtier demo longdoc``: long-document QA at the model's longest useful context.

For each document (~8K tokens for the bundled model) the TTFT of:
- recompute: the first question, nothing cached (vLLM's prefix cache is off in these servers so
  every hit below is kvtier's);
- kvtier RAM hit: a second question on the same server (document KV in kvtier's RAM tier);
- kvtier SSD hit: a third question on a FRESH server process sharing only the SSD directory,
  with the chunk files evicted from the page cache first.
The published figure to beat: 13x lower TTFT on >20K-token document QA with a distributed-FS
KV cache. ``ttft_ratio`` = mean recompute TTFT / mean SSD-hit TTFT.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError, ModelFacts, console, fmt_s, ratio, write_json


@dataclass(frozen=True)
class LongDocDemoSize:
    documents: int
    doc_tokens: int
    max_prompt_length: int
    seed: int = 11


DEFAULT = LongDocDemoSize(documents=3, doc_tokens=7600, max_prompt_length=8000)
QUICK = LongDocDemoSize(documents=1, doc_tokens=3800, max_prompt_length=4000)


def _one(url: str, conv) -> Any:
    """Send one single-turn conversation; return its RequestRecord (TTFT clock starts before send)."""
    from kvtier.bench.client import ClientOptions
    from kvtier.bench.replay import ReplayOptions, replay_conversations

    opts = ReplayOptions(mode="closed", concurrency=1, progress=False, client=ClientOptions(
        extra_body=(("max_tokens", 1),)))
    rec = asyncio.run(replay_conversations([conv], url, opts)).records[0]
    if rec.error_kind:
        raise DemoError(f"request {conv.id} failed: {rec.error_kind}: {rec.error}")
    return rec


def run(size: LongDocDemoSize, out: Path, facts: ModelFacts, *, quick: bool) -> dict[str, Any]:
    from kvtier.bench.ttft import evict_page_cache
    from kvtier.server import ServerError, ServerSpec, VllmServer
    from kvtier.workload.format import write_workload
    from kvtier.workload.longdoc import LongDocSpec, generate_longdoc
    from kvtier.workload.tokens import load_tokenizer

    console.rule("[bold]kvtier demo longdoc: long-document QA")
    spec = LongDocSpec(documents=size.documents, doc_tokens=size.doc_tokens, spread=0.0,
                       max_prompt_length=size.max_prompt_length, questions=3, interleave=1, max_tokens=1,
                       seed=size.seed)
    with console.status("generating documents"):
        header, convs = generate_longdoc(spec, load_tokenizer(facts.path))
    write_workload(out / "workload.jsonl", header, convs)
    by_doc: dict[str, list] = {}
    for c in convs:
        by_doc.setdefault(c.metadata["doc"], []).append(c)
    disk = out / "ssd"
    kv = {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": 2 * 2**30},
                    "disk": {"enabled": True, "path": str(disk), "capacity": 8 * 2**30}}}
    server = ServerSpec(name="kvtier", model=str(facts.path), max_model_len=size.max_prompt_length + 64,
                        max_num_batched_tokens=2048, kv_cache_space_gib=1, enable_prefix_caching=False,
                        kvtier_config=kv)
    rows: list[dict[str, Any]] = []
    try:
        console.print("[dim]server 1: recompute, then kvtier RAM hit[/]")
        with VllmServer.start(server, out / "server-1.log") as s1:
            for doc, qs in by_doc.items():
                cold = _one(s1.base_url, qs[0])
                ram = _one(s1.base_url, qs[1])
                rows.append({"doc": doc, "prompt_tokens": cold.prompt_tokens, "recompute_s": cold.ttft_s,
                             "ram_hit_s": ram.ttft_s, "ram_cached_tokens": ram.cached_tokens})
                console.print(f"[dim]{doc}: recompute {cold.ttft_s:.3f} s, RAM hit {ram.ttft_s:.3f} s[/]")
        evicted = evict_page_cache(disk)
        console.print(f"[dim]server 2 (fresh process): kvtier SSD hit; {evicted / 2**20:.0f} MiB of chunk files "
                      f"evicted from the page cache[/]")
        with VllmServer.start(server, out / "server-2.log") as s2:
            for row, qs in zip(rows, by_doc.values()):
                ssd = _one(s2.base_url, qs[2])
                row.update(ssd_hit_s=ssd.ttft_s, ssd_cached_tokens=ssd.cached_tokens)
    except ServerError as e:
        raise DemoError(str(e).splitlines()[0]) from None
    mean = {k: statistics.fmean(r[k] for r in rows) for k in ("recompute_s", "ram_hit_s", "ssd_hit_s")}
    t = Table(title="long-document QA: TTFT (s)")
    for col in ("document", "prompt tokens", "recompute", "kvtier RAM hit", "kvtier SSD hit (fresh server)",
                "recompute / SSD hit"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["doc"], str(r["prompt_tokens"]), fmt_s(r["recompute_s"]), fmt_s(r["ram_hit_s"]),
                  fmt_s(r["ssd_hit_s"]), f"{ratio(r['recompute_s'], r['ssd_hit_s']) or 0:.1f}x")
    t.add_row("mean", "", fmt_s(mean["recompute_s"]), fmt_s(mean["ram_hit_s"]), fmt_s(mean["ssd_hit_s"]),
              f"{ratio(mean['recompute_s'], mean['ssd_hit_s']) or 0:.1f}x")
    console.print(t)
    figures = {"ttft_ratio": ratio(mean["recompute_s"], mean["ssd_hit_s"]),
               "ram_ttft_ratio": ratio(mean["recompute_s"], mean["ram_hit_s"]),
               "recompute_mean_s": mean["recompute_s"], "ram_hit_mean_s": mean["ram_hit_s"],
               "ssd_hit_mean_s": mean["ssd_hit_s"], "documents": rows, "quick": quick, "size": asdict(size)}
    write_json(out / "demo-longdoc.json", figures)
    console.print(f"SSD-hit TTFT is [bold]{figures['ttft_ratio']:.1f}x[/] lower than recompute "
                  f"(RAM hit: {figures['ram_ttft_ratio']:.1f}x)")
    if any(not r.get("ssd_cached_tokens") for r in rows):
        raise DemoError("a fresh server reported no cached tokens on an SSD hit: the SSD tier was not used")
    return figures
