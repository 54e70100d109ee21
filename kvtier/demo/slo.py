"""``kvtier demo slo``: how many concurrent users fit under a TTFT SLO, vanilla vs kvtier RAM+SSD,
swept over document lengths (the published test swept ``--max-prompt-length``).

Long-document QA: documents revisited by many users, each asking its own question. The SLO and
the document lengths come from the calibration (``choose_slo``): the published p90 TTFT <= 2 s
where one user's cold TTFT on the shortest documents leaves room under it, otherwise a stated
multiple of this machine's cold TTFT; lengths L, 2L, 4L. For each length, on the same two servers
(one per configuration, documents of each length are new to them): a warm-up pass (``warm_questions``
per document), then the SLO search (doubling then bisection; each point >= 3 repeats with their
spread, ``min_requests_per_user`` x N requests, p90 on the steady-state window where N requests are
in flight — see ``kvtier.client.slo``), then a fixed high concurrency point measured the same way.
Vanilla gets exactly the same treatment. Every measured prompt is new to the server: it shares only
its document with earlier ones (questions are given a distinct reader tag when the question list
runs out). Published figures to beat: 8x more concurrent users under TTFT <= 2 s and > 4x lower
TTFT at 30 concurrent users.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from rich.table import Table

from kvtier.demo.calibrate import Calibration, PrefillProfile, obtain_calibration
from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError, DemoOptions, ModelFacts, console, fmt_s, ratio, write_json
from kvtier.demo.slo_sizing import documents_for, fit_slo_size, point_requests


@dataclass(frozen=True)
class SloDemoSize:
    doc_set_tokens: int             # all documents of one length together (the same for every length)
    max_users: int                  # the search's cap
    fixed_users: int                # the fixed high-concurrency point
    repeats: int = 3
    min_requests_per_user: int = 3  # a point of N users runs >= this x N requests (and >= min_requests)
    min_requests: int = 12
    questions: int = 12
    warm_questions: int = 2         # per document, for the warm-up pass; the rest are measured
    engine_kv_fraction: float = 0.25  # the engine's KV space / the document set, in tokens
    lengths: int = 3                # document lengths L, 2L, 4L, ...
    published_slo_s: float = 2.0
    slo_multiple: float = 1.5       # SLO = this x one user's cold TTFT on the shortest documents
    min_doc_tokens: int = 256
    max_doc_tokens: int = 1024      # cap of the shortest length on a fast machine
    prompt_overhead_tokens: int = 64  # question + chat template around a document
    seed: int = 13


# The reference run: 24 documents of 720 tokens (17K tokens), engine KV a quarter of it, 16 users fixed.
DEFAULT = SloDemoSize(doc_set_tokens=17_280, max_users=32, fixed_users=16)
QUICK = SloDemoSize(doc_set_tokens=7_200, max_users=8, fixed_users=8, min_requests=8, lengths=3)
TARGET_S, QUICK_TARGET_S = 900.0, 360.0   # wall time the run is shrunk towards (kvtier.demo.slo_sizing)


@dataclass(frozen=True)
class SloChoice:
    slo_s: float
    doc_tokens: tuple[int, ...]
    published: bool
    cold_ttft_s: float              # predicted single-user cold TTFT on the shortest documents
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_slo(profile: PrefillProfile, size: SloDemoSize, model_max_tokens: int = 8192) -> SloChoice:
    """The SLO and the document lengths for this machine (side-effect free, see the module doc)."""
    over = size.prompt_overhead_tokens
    fast = profile.tokens_for(size.published_slo_s / size.slo_multiple) - over
    if fast >= size.min_doc_tokens:
        first = min(fast, size.max_doc_tokens)
        cold = profile.seconds(first + over)
        slo, published = size.published_slo_s, True
        reason = (f"published {size.published_slo_s:g} s: one user's cold TTFT on {first}-token documents is "
                  f"{cold:.2f} s here (<= SLO / {size.slo_multiple:g})")
    else:
        first = size.min_doc_tokens
        cold = profile.seconds(first + over)
        slo, published = round(size.slo_multiple * cold, 2), False
        reason = (f"{size.slo_multiple:g} x this machine's single-user cold TTFT on {first}-token documents "
                  f"({cold:.2f} s): the published {size.published_slo_s:g} s would leave one cold user no margin")
    cap = (model_max_tokens - 256 - over) / 1.2
    lengths = tuple(int(min(cap, first * 2 ** i)) for i in range(size.lengths))
    if len(set(lengths)) < size.lengths:
        raise DemoError(f"the model's context ({model_max_tokens} tokens) leaves no room for {size.lengths} "
                        f"document lengths from {first} tokens")
    return SloChoice(slo_s=slo, doc_tokens=lengths, published=published, cold_ttft_s=cold, reason=reason)


def measured_prompts(convs: Sequence[Any], needed: int) -> list[Any]:
    """``convs`` followed by copies whose question carries a distinct reader tag, until ``needed``:
    no measured prompt is an exact repeat of another (each shares only its document)."""
    out = list(convs)
    k = 1
    while len(out) < needed and convs:
        for c in convs:
            t = c.turns[0]
            out.append(c.model_copy(update={"id": f"{c.id}-r{k}", "turns": [
                t.model_copy(update={"user": f"{t.user}\n(reader {k})"})]}))
        k += 1
    return out


def _requests_needed(size: SloDemoSize) -> int:
    """An upper bound of the search's requests at one length: doubling, then up to log2 bisection points."""
    doubling = [2 ** i for i in range(int(math.log2(size.max_users)) + 1)] + [size.max_users]
    loads = doubling + [size.max_users] * int(math.log2(size.max_users))
    return sum(size.repeats * point_requests(size, u) for u in loads)


def run(size: SloDemoSize, out: Path, facts: ModelFacts, opts: DemoOptions, *,
        calibration: Calibration | None = None, tokenizer=None, start_server=None) -> dict[str, Any]:
    """The demo end to end; ``calibration``/``tokenizer``/``start_server`` are injectable (tests)."""
    from kvtier.client.stream import ClientOptions
    from kvtier.client.replay import ReplayOptions, replay_conversations
    from kvtier.client.slo import SloOptions, replay_evaluator, run_slo
    from kvtier.server import ServerError, ServerSpec, VllmServer
    from kvtier.workload.format import write_workload
    from kvtier.workload.longdoc import LongDocSpec, generate_longdoc
    from kvtier.workload.tokens import load_tokenizer

    console.rule("[bold]kvtier demo slo: concurrent users under a TTFT SLO, by document length")
    cal = calibration or obtain_calibration(facts, out, opts.calibration, start_server)
    choice = choose_slo(cal.profile, size, facts.max_model_len)
    console.print(f"SLO: p90 TTFT <= [bold]{choice.slo_s:g} s[/] ({choice.reason}); document lengths "
                  f"{', '.join(map(str, choice.doc_tokens))} tokens")
    fit = fit_slo_size(size, choice.doc_tokens, choice.slo_s, cal.profile, cal.startup_s, DEMO_CHUNK_TOKENS,
                       opts.target_s or (QUICK_TARGET_S if opts.quick else TARGET_S))
    size = fit.size
    console.print(f"estimated {fit.estimate.seconds / 60:.0f} min on this machine (target {fit.target_s / 60:.0f}; "
                  + ("; ".join(fit.changed) if fit.changed else "nothing shrunk") + ")")
    if not fit.fits:
        console.print(f"[yellow]the SLO demo cannot be shrunk to {fit.target_s / 60:.0f} min here without fewer than "
                      f"{size.repeats} repeats or {size.lengths} document lengths: expect about "
                      f"{fit.estimate.seconds / 60:.0f} min[/]")
    tokenizer = tokenizer or load_tokenizer(facts.path)
    start = start_server or VllmServer.start
    workloads = {}
    for n in choice.doc_tokens:
        spec = LongDocSpec(documents=documents_for(size, n), doc_tokens=n, spread=0.2,
                           max_prompt_length=int(n * 1.2) + 256, questions=size.questions,
                           interleave=documents_for(size, n), max_tokens=4, seed=size.seed + n)
        with console.status(f"generating {spec.documents} documents of ~{n} tokens"):
            header, convs = generate_longdoc(spec, tokenizer)
        convs = [c.model_copy(update={"id": f"L{n}-{c.id}"}) for c in convs]
        write_workload(out / f"workload-{n}.jsonl", header, convs)
        warm = [c for c in convs if c.metadata["question"] < size.warm_questions]
        fixed_n = size.repeats * point_requests(size, size.fixed_users)
        measured = measured_prompts([c for c in convs if c.metadata["question"] >= size.warm_questions],
                                    _requests_needed(size) + fixed_n)
        workloads[n] = (spec, warm, measured[:-fixed_n], measured[-fixed_n:])
    max_len = max(w[0].max_prompt_length for w in workloads.values()) + 64
    # whole engine blocks, at least one full request plus a block (vLLM refuses less than max_model_len)
    engine_tokens = -(-max(int(size.doc_set_tokens * size.engine_kv_fraction), max_len + 128) // 128) * 128
    ram = facts.kv_bytes(4 * size.doc_set_tokens * len(choice.doc_tokens))
    common = dict(model=str(facts.path), max_model_len=max_len, dtype=facts.dtype,
                  kv_cache_space_gib=facts.kv_gib(engine_tokens))
    kv = {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": ram},
                    "disk": {"enabled": True, "path": str(out / "ssd"), "capacity": max(ram, 2**30)}}}
    specs = [ServerSpec(name="vanilla", **common), ServerSpec(name="kvtier-ram-ssd", kvtier_config=kv, **common)]
    console.print(f"engine KV space {engine_tokens:,} tokens ({engine_tokens / size.doc_set_tokens:.0%} of each "
                  f"length's {size.doc_set_tokens:,}-token document set; {facts.dtype}); kvtier RAM holds them all")
    base = ReplayOptions(mode="closed", concurrency=1, progress=False,
                         client=ClientOptions(extra_body=(("max_tokens", 4),)))
    slo = SloOptions(slo_s=choice.slo_s, statistic="ttft_p90_s", start=1, max_load=size.max_users,
                     repeats=size.repeats, requests_per_point=size.min_requests, steady_state=True,
                     min_requests_per_user=size.min_requests_per_user)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for s in specs:
        run_dir = out / s.name
        run_dir.mkdir(parents=True, exist_ok=True)
        results[s.name] = {}
        try:
            with start(s, run_dir / "server.log") as server:
                from kvtier.demo.calibrate import server_prefill_timer
                server_prefill_timer(server.base_url)(64)      # warm-up request (one-off costs)
                for n, (spec, warm, measured, fixed_convs) in workloads.items():
                    console.print(f"[dim]\\[{s.name}] {n}-token documents: warm-up pass ({len(warm)} requests)[/]")
                    asyncio.run(replay_conversations(warm, server.base_url, replace(base, concurrency=2)))
                    res = run_slo(measured, server.base_url, base, slo, run_dir / f"slo-{n}", on_point=lambda p, n=n, name=s.name:
                                  console.print(f"[dim]\\[{name}] {n} tokens, {int(p.load)} users: p90 TTFT "
                                                f"{fmt_s(p.value)} s (repeats {_spread(p.spread)}, in flight "
                                                f"{fmt_s(p.in_flight)}) {_verdict(p)}[/]"))
                    # the fixed point has its own prompts (none sent during the search)
                    fixed_eval = replay_evaluator(fixed_convs, server.base_url, base, replace(
                        slo, requests_per_point=point_requests(size, size.fixed_users)), run_dir / f"fixed-{n}")
                    fixed = [fixed_eval(size.fixed_users, i)[0] for i in range(size.repeats)]
                    results[s.name][n] = _length_result(res, fixed)
        except ServerError as e:
            raise DemoError(f"{s.name}: {str(e).splitlines()[0]}") from None
    rows = _rows(results, choice)
    _print_table(rows, choice, size)
    plot = plot_lengths(rows, choice, size, out / "slo_by_length.png")
    figures = {"slo": choice.to_dict(), "by_length": rows, "fixed_users": size.fixed_users,
               "repeats": size.repeats, "calibration": cal.to_dict(), "dtype": facts.dtype,
               "engine_kv_tokens": engine_tokens, "plot": str(plot), "quick": opts.quick, "size": asdict(size),
               "results": results, "sizing": fit.to_dict()}
    longest = rows[-1]
    figures["concurrency_ratio"] = rows[0]["users_ratio"]
    figures["ttft_ratio"] = longest["p90_ratio"]
    write_json(out / "demo-slo.json", figures)
    failed = [f"{r['doc_tokens']} tokens / {name}" for r in rows for name in ("vanilla", "kvtier-ram-ssd")
              if r[name]["fixed_failed"]]
    if failed:
        raise DemoError(f"requests failed at {size.fixed_users} users on: {', '.join(failed)}")
    return figures


def _spread(sp: tuple[float, float] | None) -> str:
    return "-" if not sp else f"{sp[0]:.2f}-{sp[1]:.2f} s"


def _verdict(p: Any) -> str:
    if p.value is None and not p.failed_requests:
        return "[red]no measurement (empty steady-state window)[/]"
    return "ok" if p.passed else "over SLO"


def _length_result(res: Any, fixed: list[dict[str, Any]]) -> dict[str, Any]:
    vals = [f.get("ttft_p90_s") for f in fixed]
    known = [v for v in vals if v is not None]
    return {"slo": res.to_dict(), "best_users": res.best_load, "capped": res.capped,
            "fixed_p90_s": statistics.median(known) if known and len(known) == len(vals) else None,
            "fixed_p90_values": vals, "fixed_p90_spread": (min(known), max(known)) if known else None,
            "fixed_in_flight": statistics.fmean([f["in_flight_mean"] for f in fixed
                                                 if f.get("in_flight_mean") is not None] or [0.0]),
            # None (printed "-") when no repeat measured one: never a 0% that is not a measurement
            "fixed_hit_rate": (statistics.fmean(rates) if (rates := [f["token_hit_rate"] for f in fixed
                                                                     if f.get("token_hit_rate") is not None])
                               else None),
            "fixed_failed": sum(f.get("requests_failed", 0) for f in fixed)}


def _rows(results: dict[str, dict[int, dict[str, Any]]], choice: SloChoice) -> list[dict[str, Any]]:
    rows = []
    for n in choice.doc_tokens:
        van, kvt = results["vanilla"][n], results["kvtier-ram-ssd"][n]
        rows.append({"doc_tokens": n, "vanilla": van, "kvtier-ram-ssd": kvt,
                     "users_ratio": ratio(kvt["best_users"], van["best_users"]),
                     "p90_ratio": ratio(van["fixed_p90_s"], kvt["fixed_p90_s"])})
    return rows


def _users(r: dict[str, Any]) -> str:
    return "0 (fails at 1)" if r["best_users"] is None else f"{int(r['best_users'])}{'+' if r['capped'] else ''}"


def _print_table(rows: list[dict[str, Any]], choice: SloChoice, size: SloDemoSize) -> None:
    t = Table(title=f"long-document QA, SLO p90 TTFT <= {choice.slo_s:g} s; {size.repeats} repeats per point")
    for col in ("doc tokens", "vanilla users", "kvtier users", "users ratio", f"vanilla p90 @ {size.fixed_users}",
                f"kvtier p90 @ {size.fixed_users}", "p90 ratio", "in flight (van/kvt)", "kvtier hit rate"):
        t.add_column(col, justify="right")
    for r in rows:
        v, k = r["vanilla"], r["kvtier-ram-ssd"]
        t.add_row(str(r["doc_tokens"]), _users(v), _users(k),
                  "-" if r["users_ratio"] is None else f"{r['users_ratio']:.1f}x",
                  f"{fmt_s(v['fixed_p90_s'])} ({_spread(v['fixed_p90_spread'])})",
                  f"{fmt_s(k['fixed_p90_s'])} ({_spread(k['fixed_p90_spread'])})",
                  "-" if r["p90_ratio"] is None else f"{r['p90_ratio']:.1f}x",
                  f"{v['fixed_in_flight']:.1f}/{k['fixed_in_flight']:.1f}",
                  "-" if k["fixed_hit_rate"] is None else f"{k['fixed_hit_rate']:.1%}")
    console.print(t)


def plot_lengths(rows: list[dict[str, Any]], choice: SloChoice, size: SloDemoSize, path: Path) -> Path:
    """One figure: users under the SLO and p90 TTFT at the fixed concurrency, by document length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["doc_tokens"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ("vanilla", "kvtier-ram-ssd"):
        a1.plot(xs, [r[name]["best_users"] or 0 for r in rows], marker="o", label=name)
        p90 = [r[name]["fixed_p90_s"] for r in rows]
        lo = [p - (r[name]["fixed_p90_spread"] or (p, p))[0] if p is not None else 0 for p, r in zip(p90, rows)]
        hi = [(r[name]["fixed_p90_spread"] or (p, p))[1] - p if p is not None else 0 for p, r in zip(p90, rows)]
        a2.errorbar(xs, [p or 0 for p in p90], yerr=[lo, hi], marker="o", capsize=4, label=name)
    a1.set(xlabel="document tokens", ylabel=f"max users with p90 TTFT <= {choice.slo_s:g} s",
           title="users under the SLO")
    a2.axhline(choice.slo_s, color="red", linestyle="--", label=f"SLO {choice.slo_s:g} s")
    a2.set(xlabel="document tokens", ylabel="p90 TTFT (s)", yscale="log",
           title=f"p90 TTFT at {size.fixed_users} users (spread of {size.repeats} repeats)")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.grid(True, alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
