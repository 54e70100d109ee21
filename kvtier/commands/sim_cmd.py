"""``kvtier simulate | plan | calibrate``: predict hit rate and TTFT without running a model.

Bad input (missing or malformed workload, bad profile, bad values) -> one line on stderr,
exit status 2. Heavy imports stay inside the commands.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from kvtier.commands.aliases import BASE_URL, LOAD, aliased
from kvtier.commands.json_out import is_stdout, json_option, write_json_out
from kvtier.commands.sim_cluster_cmd import replicas_option, routing_option
from kvtier.units import nbytes as fmt_bytes, percent, ratio, seconds

MODES = ("closed", "open", "trace")
MODE_HELP = "closed (N users), open (Poisson rate) or trace (the workload's arrival_s)."
CONCURRENCY_HELP = "Closed loop: concurrent users (conversations in flight)."
RATE_HELP = "Open loop: new conversations per second (Poisson arrivals)."
TIME_SCALE_HELP = "Trace mode: multiply arrival times."
THINK_HELP = "Multiply think times (0: none)."
MAX_OUTPUT_HELP = "Cap every request's output tokens (max_tokens) at this."
MAX_REQUESTS_HELP = "Issue at most this many requests."
TOKENIZER_HELP = "HF model folder, 'default' (kvtier's model) or 'approx' (chars/4, the default)."
MOONCAKE_BLOCK_HELP = "Raw Mooncake traces: tokens per hash id."
MOONCAKE_SCALE_HELP = "Raw Mooncake traces: divide lengths by this."
KV_CACHE_HELP = "vLLM's own KV cache size on the accelerator (tokens; default: the profile's)."
CHUNK_HELP = "kvtier chunk size (tokens)."
KV_BYTES_HELP = "KV cache bytes per token (all layers; default: the profile's model)."
# simulate / plan: the tier names of `kvtier serve` and the config file (memory, disk, shared)
SIM_ALIASES = {**LOAD, "--gpu-kv-tokens": "--kv-cache-tokens", "--ram": "--memory-capacity",
               "--ssd": "--disk-capacity", "--shared": "--shared-capacity", "--max-tokens": "--max-output-tokens"}
PLAN_ALIASES = {**LOAD, "--gpu-kv-tokens": "--kv-cache-tokens", "--max-tokens": "--max-output-tokens",
                "--ram-price": "--memory-price", "--ssd-price": "--disk-price"}
CALIBRATE_ALIASES = {**BASE_URL, "--timeout": "--request-timeout"}


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


@contextmanager
def _clean_errors() -> Iterator[None]:
    from kvtier.sim.load import LoadError
    from kvtier.sim.profile import ProfileError
    from kvtier.workload.format import WorkloadError
    from kvtier.workload.tokens import TokenizerError
    try:
        yield
    except (WorkloadError, TokenizerError, ProfileError, LoadError, ValueError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _size(name: str, value: Optional[str]) -> Optional[int]:
    from kvtier.config import parse_size
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def build_profile(profile: Optional[Path], *, memory_capacity: Optional[str], disk_capacity: Optional[str],
                  shared_capacity: Optional[str], kv_cache_tokens: Optional[int], chunk_size: Optional[int],
                  eviction: Optional[str], kv_bytes_per_token: Optional[int], vanilla: bool):
    """The profile file (or a preset name, or the defaults) with command-line overrides."""
    from kvtier.sim.presets import resolve_profile
    from kvtier.sim.profile import profile_from_dict
    base = resolve_profile(profile)
    data = base.model_dump()
    for tier, flag, v in (("ram", "--memory-capacity", memory_capacity), ("ssd", "--disk-capacity", disk_capacity),
                          ("shared", "--shared-capacity", shared_capacity)):
        size = _size(flag, v)
        if size is not None:
            data[tier]["capacity"] = size
    if kv_cache_tokens is not None:
        data["engine"]["kv_cache_tokens"] = kv_cache_tokens
    if chunk_size is not None:
        data["chunk_size"] = chunk_size
    if eviction is not None:
        data["eviction"] = eviction
    if kv_bytes_per_token is not None:
        data["kv_bytes_per_token"] = kv_bytes_per_token
    if vanilla:
        data["save"] = False
    return profile_from_dict(data, "command line")


def load_sim_trace(workload: Path, prof, tokenizer: Optional[str], mooncake_block: int, mooncake_scale: int,
                   max_requests: Optional[int]):
    from kvtier.sim.trace import load_trace
    tok = None
    if tokenizer not in (None, "approx"):
        from kvtier.workload.tokens import load_tokenizer
        tok = load_tokenizer(None if tokenizer == "default" else tokenizer)
    return load_trace(workload, unit_tokens=prof.engine.block_size, tokenizer=tok, mooncake_block=mooncake_block,
                      mooncake_scale=mooncake_scale, max_requests=max_requests)


def _progress(total: int, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    if not enabled or total < 20000:
        return None, None
    bar = Progress(TextColumn("simulate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True)
    task = bar.add_task("sim", total=total)
    return bar, (lambda done: bar.update(task, completed=done))


def simulate(
    workload: Path = typer.Argument(..., help="Workload JSONL file, or a raw Mooncake trace (hash_ids)."),
    profile: Optional[Path] = typer.Option(None, "--profile", "-p", help="Profile YAML (kvtier calibrate) or a "
                                           "preset ACCELERATOR/MODEL (default h100/llama-3-8b; docs/simulator.md)."),
    memory_capacity: Optional[str] = typer.Option(None, "--memory-capacity", help="kvtier RAM tier capacity, "
                                                  "e.g. 64GiB (0: off; default: the profile's)."),
    disk_capacity: Optional[str] = typer.Option(None, "--disk-capacity", help="kvtier SSD tier capacity, e.g. "
                                                "2TiB (0: off; default: the profile's)."),
    shared_capacity: Optional[str] = typer.Option(None, "--shared-capacity", help="Shared tier capacity "
                                                  "(0: off; default: the profile's)."),
    vanilla: bool = typer.Option(False, "--vanilla", help="vLLM alone: kvtier neither loads nor saves."),
    kv_cache_tokens: Optional[int] = typer.Option(None, "--kv-cache-tokens", min=0, help=KV_CACHE_HELP),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", min=1, help=CHUNK_HELP),
    eviction: Optional[str] = typer.Option(None, "--eviction", help="Eviction policy of the tiers: lru or cost."),
    kv_bytes_per_token: Optional[int] = typer.Option(None, "--kv-bytes-per-token", min=1, help=KV_BYTES_HELP),
    mode: str = typer.Option("closed", "--mode", help=MODE_HELP),
    max_concurrency: int = typer.Option(4, "--max-concurrency", "-c", help=CONCURRENCY_HELP),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help=RATE_HELP),
    time_scale: float = typer.Option(1.0, "--time-scale", help=TIME_SCALE_HELP),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale", help=THINK_HELP),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help=MAX_REQUESTS_HELP),
    duration: Optional[float] = typer.Option(None, "--duration", help="Send no request after this many seconds."),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens", help=MAX_OUTPUT_HELP),
    seed: int = typer.Option(0, "--seed", help="Open loop: arrival seed."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help=TOKENIZER_HELP),
    mooncake_block: int = typer.Option(512, "--mooncake-block", help=MOONCAKE_BLOCK_HELP),
    mooncake_scale: int = typer.Option(1, "--mooncake-scale", help=MOONCAKE_SCALE_HELP),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write summary.json, requests.jsonl, plots here."),
    json_path: Optional[Path] = json_option("the summary"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on long runs."),
    replicas: Optional[int] = replicas_option(),
    routing: Optional[str] = routing_option(),
) -> None:
    """Replay a workload through a model of vLLM + kvtier: TTFT and hit rate, no model run."""
    from kvtier.sim.load import LoadSpec
    from kvtier.sim.run import simulate as run_sim, write_json, write_outputs

    with _clean_errors():
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        if eviction is not None and eviction not in ("lru", "cost"):
            raise ValueError(f"--eviction must be lru or cost, got {eviction!r}")
        load = LoadSpec(mode=mode, concurrency=max_concurrency, rate=request_rate,
                        think_time_scale=think_time_scale, time_scale=time_scale, seed=seed,
                        max_requests=max_requests, duration_s=duration, max_tokens=max_output_tokens)
        load.validate()
        from kvtier.commands.sim_cluster_cmd import check_cluster_options, simulate_cluster_command
        routing = check_cluster_options(replicas, routing)
        prof = build_profile(profile, memory_capacity=memory_capacity, disk_capacity=disk_capacity,
                             shared_capacity=shared_capacity, kv_cache_tokens=kv_cache_tokens,
                             chunk_size=chunk_size, eviction=eviction, kv_bytes_per_token=kv_bytes_per_token,
                             vanilla=vanilla)
        trace = load_sim_trace(workload, prof, tokenizer, mooncake_block, mooncake_scale, max_requests)
        if replicas is not None:
            simulate_cluster_command(trace, prof, load, replicas, routing, out, json_path)
            return
        bar, cb = _progress(trace.num_requests, progress and not is_stdout(json_path))   # (stdout is the JSON)
        if bar is not None:
            with bar:
                sim = run_sim(trace, prof, load, progress=cb)
        else:
            sim = run_sim(trace, prof, load)
        if out is not None:
            write_outputs(sim, out)
        if json_path is not None:
            if is_stdout(json_path):
                write_json_out(json_path, sim.summary)
                return
            write_json(json_path, sim.summary)
    from kvtier.commands.bench_cmd import print_summary
    s = sim.summary
    s.setdefault("stopped_reason", "workload exhausted")
    print_summary(s, title=f"simulated: {workload.name} ({trace.num_requests} requests)")
    tiers = ", ".join(f"{k} {percent(v)}" for k, v in s["tier_hit_rate"].items() if v)
    typer.echo(f"hit rate by tier: {tiers or 'none'}")


def write_plan(d: dict, out: Optional[Path], json_path: Optional[Path]) -> bool:
    """``plan.json`` under ``--out`` and the ``--json`` copy; True when the JSON went to stdout (print nothing else)."""
    from kvtier.sim.run import write_json

    if out is not None:
        write_json(out / "plan.json", d)
    if json_path is not None:
        if is_stdout(json_path):
            write_json_out(json_path, d)
            return True
        write_json(json_path, d)
    return False


def plan(
    workload: Path = typer.Argument(..., help="Workload JSONL file, or a raw Mooncake trace (hash_ids)."),
    profile: Optional[Path] = typer.Option(None, "--profile", "-p", help="Profile YAML or preset ACCELERATOR/MODEL "
                                           "(default h100/llama-3-8b)."),
    target: float = typer.Option(0.9, "--target", help="Fraction of the ideal hit rate to reach (0-1]."),
    target_ttft: Optional[float] = typer.Option(None, "--target-ttft", help="Mean TTFT (s) to meet instead."),
    shared_tier: bool = typer.Option(False, "--shared-tier", help="Size a shared tier instead of a local SSD."),
    memory_price: float = typer.Option(4.0, "--memory-price", help="Relative cost per GiB of RAM."),
    disk_price: float = typer.Option(0.1, "--disk-price", help="Relative cost per GiB of SSD."),
    shared_price: float = typer.Option(0.05, "--shared-price", help="Relative cost per GiB of shared storage."),
    sample_rate: Optional[float] = typer.Option(None, "--sample-rate", help="SHARDS sampling rate (default: "
                                                "exact up to 2M chunk accesses)."),
    kv_cache_tokens: Optional[int] = typer.Option(None, "--kv-cache-tokens", min=0, help=KV_CACHE_HELP),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", min=1, help=CHUNK_HELP),
    mode: str = typer.Option("closed", "--mode", help=MODE_HELP),
    max_concurrency: int = typer.Option(4, "--max-concurrency", "-c", help=CONCURRENCY_HELP),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help=RATE_HELP),
    time_scale: float = typer.Option(1.0, "--time-scale", help=TIME_SCALE_HELP),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale", help=THINK_HELP),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens", help=MAX_OUTPUT_HELP),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help=MAX_REQUESTS_HELP),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help=TOKENIZER_HELP),
    mooncake_block: int = typer.Option(512, "--mooncake-block", help=MOONCAKE_BLOCK_HELP),
    mooncake_scale: int = typer.Option(1, "--mooncake-scale", help=MOONCAKE_SCALE_HELP),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write plan.json and mrc.png here."),
    json_path: Optional[Path] = json_option("the plan"),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Size the shared tier of a cluster of this "
                                           "many replicas (one load, --routing; the profile's RAM / SSD per "
                                           "replica, or --memory-capacity / --disk-capacity)."),
    routing: Optional[str] = routing_option(),
    memory_capacity: Optional[str] = typer.Option(None, "--memory-capacity", help="With --replicas: kvtier RAM "
                                                  "tier per replica (default: the profile's)."),
    disk_capacity: Optional[str] = typer.Option(None, "--disk-capacity", help="With --replicas: kvtier SSD tier "
                                                "per replica (default: the profile's)."),
) -> None:
    """How much RAM / SSD / shared storage, and what it buys: miss-ratio curve + simulated TTFT."""
    from kvtier.sim.load import LoadSpec
    from kvtier.sim.planner import Prices, make_plan, plot_curve

    with _clean_errors():
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not 0 < target <= 1:
            raise ValueError(f"--target must be in (0, 1], got {target}")
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(f"--sample-rate must be in (0, 1], got {sample_rate}")
        if min(memory_price, disk_price, shared_price) < 0:
            raise ValueError("prices must be >= 0")
        load = LoadSpec(mode=mode, concurrency=max_concurrency, rate=request_rate,
                        think_time_scale=think_time_scale, time_scale=time_scale, max_tokens=max_output_tokens,
                        max_requests=max_requests)
        load.validate()
        from kvtier.commands.sim_cluster_cmd import check_cluster_options, plan_cluster_command
        routing = check_cluster_options(replicas, routing)
        if replicas is None and (memory_capacity is not None or disk_capacity is not None):
            raise ValueError("--memory-capacity and --disk-capacity apply with --replicas (the single-machine "
                             "plan sizes RAM and SSD itself)")
        if replicas is not None and target_ttft is not None:
            raise ValueError("--target-ttft is not supported with --replicas (the cluster plan meets --target)")
        if replicas is not None and shared_tier:
            raise ValueError("--shared-tier is implied by --replicas (the cluster's shared tier is sized)")
        prof = build_profile(profile, memory_capacity=memory_capacity, disk_capacity=disk_capacity,
                             shared_capacity=None, kv_cache_tokens=kv_cache_tokens,
                             chunk_size=chunk_size, eviction=None, kv_bytes_per_token=None, vanilla=False)
        trace = load_sim_trace(workload, prof, tokenizer, mooncake_block, mooncake_scale, max_requests)
        if replicas is not None:
            plan_cluster_command(trace, prof, load, replicas, routing, target, sample_rate, out, json_path)
            return
        p = make_plan(trace, prof, load, target=target, target_ttft_s=target_ttft,
                      prices=Prices(memory_price, disk_price, shared_price), sample_rate=sample_rate,
                      with_shared=shared_tier)
        to_stdout = write_plan(p.to_dict(), out, json_path)
        if out is not None:
            plot_curve(p, out / "mrc.png", prof.engine.kv_cache_tokens * prof.kv_bytes_per_token)
        if to_stdout:
            return
    from rich.console import Console
    from rich.table import Table
    con = Console()
    f3, pc = seconds, percent
    con.print(f"ideal hit rate {pc(p.ideal_hit_rate)} (sample rate {p.sample_rate:g}); "
              f"{target:.0%} of it needs {fmt_bytes(p.knee_bytes)} of cache; vLLM alone: mean TTFT "
              f"{f3(p.baseline['ttft_mean_s'])}, hit rate {pc(p.baseline['token_hit_rate'])}")
    t = Table(title="what each size buys (one LRU tier, from the curve)")
    t.add_column("capacity")
    t.add_column("token hit rate")
    for frac in (0.125, 0.25, 0.5, 1.0, 2.0):
        if p.knee_bytes:
            cap = p.knee_bytes * frac
            hr = max((c["token_hit_rate"] for c in p.curve if c["capacity_bytes"] <= cap), default=0.0)
            t.add_row(fmt_bytes(cap), pc(hr))
    con.print(t)
    t = Table(title="simulated candidates, cheapest first")
    for col in ("RAM", "SSD", "shared", "cost", "hit rate (curve)", "hit rate (sim)", "TTFT mean", "speedup",
                "meets"):
        t.add_column(col)
    base = p.baseline["ttft_mean_s"] or 0.0
    for c in p.candidates:
        t.add_row(fmt_bytes(c.ram_bytes), fmt_bytes(c.ssd_bytes), fmt_bytes(c.shared_bytes), f"{c.cost:.3g}",
                  pc(c.predicted_hit_rate), pc(c.token_hit_rate), f3(c.ttft_mean_s),
                  ratio(base / c.ttft_mean_s) if c.ttft_mean_s else "–", "yes" if c.meets else "no")
    con.print(t)
    if p.best is None:
        con.print("no simulated candidate met the target")


def calibrate(
    base_url: str = typer.Option(..., "--base-url", help="Server root of a running OpenAI-compatible vLLM server, "
                                 "e.g. http://127.0.0.1:8000."),
    out: Path = typer.Option(..., "--out", "-o", help="Profile YAML to write (atomically)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name (default: first of /v1/models)."),
    lengths: str = typer.Option("128,512,1024,2048", "--lengths", help="Prompt lengths to probe (tokens)."),
    suffix: int = typer.Option(64, "--suffix", help="New tokens after a cached prefix."),
    repeats: int = typer.Option(2, "--repeats", help="Probes per prompt length (medians)."),
    batch: int = typer.Option(4, "--batch", help="Concurrent requests for the batched decode probe."),
    decode_tokens: int = typer.Option(16, "--decode-tokens", help="Output tokens of each decode probe."),
    block_size: int = typer.Option(16, "--block-size", min=1, help="The server's KV block size."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", min=1,
                                               help="The server's token budget per step."),
    kv_cache_tokens: int = typer.Option(100_000, "--kv-cache-tokens", min=0, help="The server's KV cache (tokens)."),
    kv_bytes_per_token: int = typer.Option(131072, "--kv-bytes-per-token", min=1, help="The model's KV cache "
                                           "bytes per token (all layers)."),
    disk_path: Optional[Path] = typer.Option(None, "--disk-path", help="Measure SSD bandwidth in this directory."),
    probe_mib: int = typer.Option(256, "--probe-mib", min=1, help="Size of the RAM / SSD bandwidth probes."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help="Per-request timeout of each probe (s)."),
    json_path: Optional[Path] = json_option("the raw measurements and the fit"),
) -> None:
    """Measure a running vLLM server and the local tiers; write a profile for `kvtier simulate`."""
    from dataclasses import asdict

    from kvtier.sim.calibrate import CalibrateError, CalibrateOptions, calibrate as run_cal
    from kvtier.sim.profile import save_profile
    from kvtier.sim.run import write_json

    with _clean_errors():
        try:
            lens = tuple(int(x) for x in lengths.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--lengths must be comma-separated integers, got {lengths!r}") from None
        opts = CalibrateOptions(url=base_url, model=model, lengths=lens, suffix=suffix, repeats=repeats, batch=batch,
                                decode_tokens=decode_tokens, block_size=block_size,
                                max_num_batched_tokens=max_num_batched_tokens, kv_cache_tokens=kv_cache_tokens,
                                kv_bytes_per_token=kv_bytes_per_token, timeout_s=request_timeout, disk_path=disk_path,
                                probe_bytes=probe_mib * 2**20)
        try:
            prof, meas, fit = run_cal(opts)
        except CalibrateError as e:
            _fail(str(e).splitlines()[0])
        save_profile(prof, out)
        if is_stdout(json_path):
            write_json_out(json_path, {"measurements": asdict(meas), "fit": asdict(fit)})
        elif json_path is not None:
            write_json(json_path, {"measurements": asdict(meas), "fit": asdict(fit)})
    typer.echo(f"profile written: {out} (prefill fit error {percent(fit.prefill_rel_error)}; step overhead "
               f"{seconds(fit.step_overhead_s)}, {fit.prefill_token_s * 1e6:.2f} us/token, decode "
               f"{seconds(fit.decode_seq_s)}/sequence)", err=is_stdout(json_path))


def register(app: typer.Typer) -> None:
    app.command("simulate", cls=aliased(SIM_ALIASES))(simulate)
    app.command("plan", cls=aliased(PLAN_ALIASES))(plan)
    app.command("calibrate", cls=aliased(CALIBRATE_ALIASES))(calibrate)
