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
                                           "preset name (kvtier simulate --list-presets)."),
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
        bar, cb = _progress(trace.num_requests, progress and json_out is None or (json_out is not None
                                                                              and str(json_out) != "-"))
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


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
