"""``kvtier simulate | plan | calibrate``: predict hit rate and TTFT without running a model.

Bad input (missing or malformed workload, bad profile, bad values) -> one line on stderr,
exit status 2. Heavy imports stay inside the commands.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

MODES = ("closed", "open", "trace")


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


def build_profile(profile: Optional[Path], *, ram: Optional[str], ssd: Optional[str], shared: Optional[str],
                  gpu_kv_tokens: Optional[int], chunk_size: Optional[int], eviction: Optional[str],
                  kv_bytes_per_token: Optional[int], vanilla: bool):
    """The profile file (or a preset name, or the defaults) with command-line overrides."""
    from kvtier.sim.presets import resolve_profile
    from kvtier.sim.profile import profile_from_dict
    base = resolve_profile(profile)
    data = base.model_dump()
    for tier, v in (("ram", ram), ("ssd", ssd), ("shared", shared)):
        size = _size(f"--{tier}", v)
        if size is not None:
            data[tier]["capacity"] = size
    if gpu_kv_tokens is not None:
        data["engine"]["kv_cache_tokens"] = gpu_kv_tokens
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
    ram: Optional[str] = typer.Option(None, "--ram", help="kvtier RAM tier capacity, e.g. 64GiB (0: off)."),
    ssd: Optional[str] = typer.Option(None, "--ssd", help="kvtier SSD tier capacity (0: off)."),
    shared: Optional[str] = typer.Option(None, "--shared", help="shared tier capacity (0: off)."),
    vanilla: bool = typer.Option(False, "--vanilla", help="vLLM alone: kvtier neither loads nor saves."),
    gpu_kv_tokens: Optional[int] = typer.Option(None, "--gpu-kv-tokens", min=0, help="vLLM KV cache size (tokens)."),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", min=1, help="kvtier chunk tokens."),
    eviction: Optional[str] = typer.Option(None, "--eviction", help="lru or cost."),
    kv_bytes_per_token: Optional[int] = typer.Option(None, "--kv-bytes-per-token", min=1),
    mode: str = typer.Option("closed", "--mode", help="closed (N users), open (Poisson rate) or trace (arrival_s)."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", help="Closed loop: concurrent users."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Open loop: new conversations per second."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Trace mode: multiply arrival times."),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale", help="Multiply think times (0: none)."),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help="Issue at most this many requests."),
    duration: Optional[float] = typer.Option(None, "--duration", help="Send no request after this many seconds."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Clip every request's output tokens."),
    seed: int = typer.Option(0, "--seed", help="Open loop arrivals seed."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="HF model folder, 'default' (kvtier's "
                                            "model) or 'approx' (chars/4, the default)."),
    mooncake_block: int = typer.Option(512, "--mooncake-block", help="Raw Mooncake traces: tokens per hash id."),
    mooncake_scale: int = typer.Option(1, "--mooncake-scale", help="Raw Mooncake traces: divide lengths by this."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write summary.json, requests.jsonl, plots here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the summary as JSON here ('-': stdout)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on long runs."),
) -> None:
    """Replay a workload through a model of vLLM + kvtier: TTFT and hit rate, no model run."""
    from kvtier.sim.load import LoadSpec
    from kvtier.sim.run import simulate as run_sim, write_json, write_outputs

    with _clean_errors():
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        if eviction is not None and eviction not in ("lru", "cost"):
            raise ValueError(f"--eviction must be lru or cost, got {eviction!r}")
        load = LoadSpec(mode=mode, concurrency=concurrency, rate=rate, think_time_scale=think_time_scale,
                        time_scale=time_scale, seed=seed, max_requests=max_requests, duration_s=duration,
                        max_tokens=max_tokens)
        load.validate()
        prof = build_profile(profile, ram=ram, ssd=ssd, shared=shared, gpu_kv_tokens=gpu_kv_tokens,
                             chunk_size=chunk_size, eviction=eviction, kv_bytes_per_token=kv_bytes_per_token,
                             vanilla=vanilla)
        trace = load_sim_trace(workload, prof, tokenizer, mooncake_block, mooncake_scale, max_requests)
        bar, cb = _progress(trace.num_requests, progress and str(json_out) != "-")   # (stdout is the JSON)
        if bar is not None:
            with bar:
                sim = run_sim(trace, prof, load, progress=cb)
        else:
            sim = run_sim(trace, prof, load)
        if out is not None:
            write_outputs(sim, out)
        if json_out is not None:
            if str(json_out) == "-":
                sys.stdout.write(json.dumps(sim.summary, indent=2, default=float) + "\n")
                return
            write_json(json_out, sim.summary)
    from kvtier.commands.bench_cmd import print_summary
    s = sim.summary
    s.setdefault("stopped_reason", "workload exhausted")
    print_summary(s, title=f"simulated: {workload.name} ({trace.num_requests} requests)")
    tiers = ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["tier_hit_rate"].items() if v)
    typer.echo(f"hit rate by tier: {tiers or 'none'}")


def plan(
    workload: Path = typer.Argument(..., help="Workload JSONL file, or a raw Mooncake trace (hash_ids)."),
    profile: Optional[Path] = typer.Option(None, "--profile", "-p", help="Profile YAML or preset ACCELERATOR/MODEL "
                                           "(default h100/llama-3-8b)."),
    target: float = typer.Option(0.9, "--target", help="Fraction of the ideal hit rate to reach (0-1]."),
    target_ttft: Optional[float] = typer.Option(None, "--target-ttft", help="Mean TTFT (s) to meet instead."),
    shared_tier: bool = typer.Option(False, "--shared-tier", help="Size a shared tier instead of a local SSD."),
    ram_price: float = typer.Option(4.0, "--ram-price", help="Relative cost per GiB of RAM."),
    ssd_price: float = typer.Option(0.1, "--ssd-price", help="Relative cost per GiB of SSD."),
    shared_price: float = typer.Option(0.05, "--shared-price", help="Relative cost per GiB of shared storage."),
    sample_rate: Optional[float] = typer.Option(None, "--sample-rate", help="SHARDS sampling rate (default: "
                                                "exact up to 2M chunk accesses)."),
    gpu_kv_tokens: Optional[int] = typer.Option(None, "--gpu-kv-tokens", min=0),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", min=1),
    mode: str = typer.Option("closed", "--mode"),
    concurrency: int = typer.Option(4, "--concurrency", "-c"),
    rate: Optional[float] = typer.Option(None, "--rate"),
    time_scale: float = typer.Option(1.0, "--time-scale"),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens"),
    max_requests: Optional[int] = typer.Option(None, "--max-requests"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer"),
    mooncake_block: int = typer.Option(512, "--mooncake-block"),
    mooncake_scale: int = typer.Option(1, "--mooncake-scale"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write plan.json and mrc.png here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the plan as JSON here ('-': stdout)."),
) -> None:
    """How much RAM / SSD / shared storage, and what it buys: miss-ratio curve + simulated TTFT."""
    from kvtier.sim.load import LoadSpec
    from kvtier.sim.planner import Prices, fmt_bytes, make_plan, plot_curve
    from kvtier.sim.run import write_json

    with _clean_errors():
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not 0 < target <= 1:
            raise ValueError(f"--target must be in (0, 1], got {target}")
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(f"--sample-rate must be in (0, 1], got {sample_rate}")
        if min(ram_price, ssd_price, shared_price) < 0:
            raise ValueError("prices must be >= 0")
        load = LoadSpec(mode=mode, concurrency=concurrency, rate=rate, think_time_scale=think_time_scale,
                        time_scale=time_scale, max_tokens=max_tokens, max_requests=max_requests)
        load.validate()
        prof = build_profile(profile, ram=None, ssd=None, shared=None, gpu_kv_tokens=gpu_kv_tokens,
                             chunk_size=chunk_size, eviction=None, kv_bytes_per_token=None, vanilla=False)
        trace = load_sim_trace(workload, prof, tokenizer, mooncake_block, mooncake_scale, max_requests)
        p = make_plan(trace, prof, load, target=target, target_ttft_s=target_ttft,
                      prices=Prices(ram_price, ssd_price, shared_price), sample_rate=sample_rate,
                      with_shared=shared_tier)
        d = p.to_dict()
        if out is not None:
            write_json(out / "plan.json", d)
            plot_curve(p, out / "mrc.png", prof.engine.kv_cache_tokens * prof.kv_bytes_per_token)
        if json_out is not None:
            if str(json_out) == "-":
                sys.stdout.write(json.dumps(d, indent=2, default=float) + "\n")
                return
            write_json(json_out, d)
    from rich.console import Console
    from rich.table import Table
    con = Console()
    def f3(v) -> str:
        return "–" if v is None else f"{v:.3f}"

    def pc(v) -> str:
        return "–" if v is None else f"{v:.1%}"
    con.print(f"ideal hit rate {p.ideal_hit_rate:.1%} (sample rate {p.sample_rate:g}); "
              f"{target:.0%} of it needs {fmt_bytes(p.knee_bytes)} of cache; vLLM alone: mean TTFT "
              f"{f3(p.baseline['ttft_mean_s'])} s, hit rate {pc(p.baseline['token_hit_rate'])}")
    t = Table(title="what each size buys (one LRU tier, from the curve)")
    t.add_column("capacity")
    t.add_column("token hit rate")
    for frac in (0.125, 0.25, 0.5, 1.0, 2.0):
        if p.knee_bytes:
            cap = p.knee_bytes * frac
            hr = max((c["token_hit_rate"] for c in p.curve if c["capacity_bytes"] <= cap), default=0.0)
            t.add_row(fmt_bytes(cap), f"{hr:.1%}")
    con.print(t)
    t = Table(title="simulated candidates, cheapest first")
    for col in ("RAM", "SSD", "shared", "cost", "hit rate (curve)", "hit rate (sim)", "TTFT mean", "speedup",
                "meets"):
        t.add_column(col)
    base = p.baseline["ttft_mean_s"] or 0.0
    for c in p.candidates:
        t.add_row(fmt_bytes(c.ram_bytes), fmt_bytes(c.ssd_bytes), fmt_bytes(c.shared_bytes), f"{c.cost:.3g}",
                  pc(c.predicted_hit_rate), pc(c.token_hit_rate), f3(c.ttft_mean_s),
                  f"{base / c.ttft_mean_s:.2f}x" if c.ttft_mean_s else "–", "yes" if c.meets else "no")
    con.print(t)
    if p.best is None:
        con.print("no simulated candidate met the target")


def calibrate(
    url: str = typer.Option(..., "--url", help="Server root of a running OpenAI-compatible vLLM server."),
    out: Path = typer.Option(..., "--out", "-o", help="Profile YAML to write (atomically)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name (default: first of /v1/models)."),
    lengths: str = typer.Option("128,512,1024,2048", "--lengths", help="Prompt lengths to probe (tokens)."),
    suffix: int = typer.Option(64, "--suffix", help="New tokens after a cached prefix."),
    repeats: int = typer.Option(2, "--repeats"),
    batch: int = typer.Option(4, "--batch", help="Concurrent requests for the batched decode probe."),
    decode_tokens: int = typer.Option(16, "--decode-tokens"),
    block_size: int = typer.Option(16, "--block-size", min=1, help="The server's KV block size."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", min=1,
                                               help="The server's token budget per step."),
    kv_cache_tokens: int = typer.Option(100_000, "--kv-cache-tokens", min=0, help="The server's KV cache (tokens)."),
    kv_bytes_per_token: int = typer.Option(131072, "--kv-bytes-per-token", min=1),
    disk_path: Optional[Path] = typer.Option(None, "--disk-path", help="Measure SSD bandwidth in this directory."),
    probe_mib: int = typer.Option(256, "--probe-mib", min=1, help="Size of the RAM / SSD bandwidth probes."),
    timeout: float = typer.Option(300.0, "--timeout", help="Deadline of one probe request (s)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the raw measurements as JSON."),
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
        opts = CalibrateOptions(url=url, model=model, lengths=lens, suffix=suffix, repeats=repeats, batch=batch,
                                decode_tokens=decode_tokens, block_size=block_size,
                                max_num_batched_tokens=max_num_batched_tokens, kv_cache_tokens=kv_cache_tokens,
                                kv_bytes_per_token=kv_bytes_per_token, timeout_s=timeout, disk_path=disk_path,
                                probe_bytes=probe_mib * 2**20)
        try:
            prof, meas, fit = run_cal(opts)
        except CalibrateError as e:
            _fail(str(e).splitlines()[0])
        save_profile(prof, out)
        if json_out is not None:
            write_json(json_out, {"measurements": asdict(meas), "fit": asdict(fit)})
    typer.echo(f"profile written: {out} (prefill fit error {fit.prefill_rel_error:.1%}; step overhead "
               f"{fit.step_overhead_s * 1e3:.2f} ms, {fit.prefill_token_s * 1e6:.2f} us/token, decode "
               f"{fit.decode_seq_s * 1e3:.3f} ms/sequence)")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
    app.command("plan")(plan)
    app.command("calibrate")(calibrate)
