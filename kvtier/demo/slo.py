"""``kvtier demo slo``: how many concurrent users fit under a TTFT SLO, vanilla vs kvtier RAM+SSD.

Long-document QA (documents revisited by many users, each asking its own question). Each server is
warmed with ``warm_questions`` questions per document (its cache holds what it can: vLLM's prefix
cache in its small KV space, kvtier's RAM+SSD tiers everything), then ``kvtier bench slo``
searches the largest number of closed-loop users whose p90 TTFT stays within the SLO (doubling,
then bisection) on the other questions — prompts the server has not seen, sharing only the
document with earlier ones — and one more point measures p90 TTFT at a fixed high concurrency. Published figures to beat: 8x more concurrent
users under TTFT <= 2 s and > 4x lower TTFT at 30 concurrent users.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError, ModelFacts, console, fmt_s, ratio, write_json


@dataclass(frozen=True)
class SloDemoSize:
    documents: int
    doc_tokens: int
    questions: int
    max_users: int
    fixed_users: int
    requests_per_point: int
    slo_s: float = 2.0
    engine_kv_gib: float = 0.25
    warm_questions: int = 2         # per document, for the warm-up pass; the rest are measured
    seed: int = 13


# Documents are sized so that a miss still meets the SLO for one user (p90 ~1.2 s at 600 tokens,
# ~1.5 s at 720 on one core: vanilla must serve one user, or the ratio has no denominator) while all
# documents together are several times the engine's KV space.
# 12 questions per document: 2 warm the caches, 10 are measured (240 distinct prompts by default: the
# search's points and the fixed point together use about that many before any prompt repeats).
DEFAULT = SloDemoSize(documents=24, doc_tokens=720, questions=12, max_users=32, fixed_users=16,
                      requests_per_point=24, engine_kv_gib=0.1)
QUICK = SloDemoSize(documents=12, doc_tokens=600, questions=12, max_users=8, fixed_users=8,
                    requests_per_point=16, engine_kv_gib=0.1)


def run(size: SloDemoSize, out: Path, facts: ModelFacts, *, quick: bool) -> dict[str, Any]:
    from kvtier.bench.client import ClientOptions
    from kvtier.bench.replay import ReplayOptions, replay_conversations
    from kvtier.bench.slo import SloOptions, run_slo
    from kvtier.server import ServerError, ServerSpec, VllmServer
    from kvtier.workload.format import write_workload
    from kvtier.workload.longdoc import LongDocSpec, generate_longdoc
    from kvtier.workload.tokens import load_tokenizer

    console.rule("[bold]kvtier demo slo: concurrent users under a TTFT SLO")
    spec = LongDocSpec(documents=size.documents, doc_tokens=size.doc_tokens, spread=0.2,
                       max_prompt_length=size.doc_tokens * 2 + 256, questions=size.questions,
                       interleave=size.documents, max_tokens=4, seed=size.seed)
    with console.status("generating documents"):
        header, convs = generate_longdoc(spec, load_tokenizer(facts.path))
    write_workload(out / "workload.jsonl", header, convs)
    warm = [c for c in convs if c.metadata["question"] < size.warm_questions]
    measured = [c for c in convs if c.metadata["question"] >= size.warm_questions]
    fixed_n = size.requests_per_point * 2
    base = ReplayOptions(mode="closed", concurrency=1, progress=False,
                         client=ClientOptions(extra_body=(("max_tokens", 4),)))
    slo = SloOptions(slo_s=size.slo_s, statistic="ttft_p90_s", start=1, max_load=size.max_users,
                     requests_per_point=size.requests_per_point)
    common = dict(model=str(facts.path), max_model_len=spec.max_prompt_length + 64,
                  kv_cache_space_gib=size.engine_kv_gib)
    kv = {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": 512 * 2**20},
                    "disk": {"enabled": True, "path": str(out / "ssd"), "capacity": 8 * 2**30}}}
    specs = [ServerSpec(name="vanilla", **common), ServerSpec(name="kvtier-ram-ssd", kvtier_config=kv, **common)]
    results: dict[str, dict[str, Any]] = {}
    for s in specs:
        run_dir = out / s.name
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            with VllmServer.start(s, run_dir / "server.log") as server:
                console.print(f"[dim][{s.name}] warm-up pass: {len(warm)} requests, {size.warm_questions} "
                              f"questions per document[/]")
                asyncio.run(replay_conversations(warm, server.base_url, replace(base, concurrency=2)))
                console.print(f"[dim][{s.name}] SLO search (p90 TTFT <= {size.slo_s} s, up to {size.max_users} "
                              f"users)[/]")
                res = run_slo(measured, server.base_url, base, slo, run_dir / "slo", on_point=lambda p, n=s.name:
                              console.print(f"[dim][{n}] {int(p.load)} users: p90 TTFT {fmt_s(p.value)} s "
                                            f"{'ok' if p.passed else 'over SLO'}[/]"))
                # the fixed point replays the end of the measured list, the part the search reaches last
                fixed = asyncio.run(replay_conversations(measured, server.base_url, replace(
                    base, concurrency=size.fixed_users, max_requests=fixed_n,
                    conversation_offset=max(0, len(measured) - fixed_n)))).summary
        except ServerError as e:
            raise DemoError(f"{s.name}: {str(e).splitlines()[0]}") from None
        results[s.name] = {"slo": res.to_dict(), "best_users": res.best_load, "capped": res.capped,
                           "fixed": fixed}
    van, kvt = results["vanilla"], results["kvtier-ram-ssd"]
    t = Table(title=f"long-document QA, SLO p90 TTFT <= {size.slo_s} s")
    for col in ("configuration", "max users under SLO", f"p90 TTFT @ {size.fixed_users} users",
                f"mean TTFT @ {size.fixed_users} users", "token hit rate"):
        t.add_column(col, justify="right")
    for name, r in results.items():
        users = "0 (fails at 1)" if r["best_users"] is None else f"{int(r['best_users'])}{'+' if r['capped'] else ''}"
        t.add_row(name, users, fmt_s(r["fixed"].get("ttft_p90_s")), fmt_s(r["fixed"].get("ttft_mean_s")),
                  f"{(r['fixed'].get('token_hit_rate') or 0):.1%}")
    console.print(t)
    figures = {"concurrency_ratio": ratio(kvt["best_users"], van["best_users"]),
               "ttft_ratio": ratio(van["fixed"].get("ttft_p90_s"), kvt["fixed"].get("ttft_p90_s")),
               "vanilla_max_users": van["best_users"], "kvtier_max_users": kvt["best_users"],
               "kvtier_capped": kvt["capped"], "fixed_users": size.fixed_users, "results": results,
               "warm_requests": len(warm), "measured_prompts": len(measured),
               "quick": quick, "size": asdict(size)}
    write_json(out / "demo-slo.json", figures)
    console.print(f"kvtier sustains {figures['concurrency_ratio'] or '-'}x the users of vanilla under the SLO"
                  f"{' (capped by the search limit)' if kvt['capped'] else ''}; p90 TTFT at "
                  f"{size.fixed_users} users is {figures['ttft_ratio'] or 0:.1f}x lower")
    failed = [n for n, r in results.items() if r["fixed"].get("requests_failed")]
    if failed:
        raise DemoError(f"requests failed at {size.fixed_users} users on: {', '.join(failed)}")
    return figures
