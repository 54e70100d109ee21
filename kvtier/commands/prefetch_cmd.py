"""``kvtier bench prefetch``: returning turns with and without queue-time prefetch on a replica whose only
source of history is the shared tier (``kvtier.bench.prefetch_bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvtier.commands.bench_cmd import CONCURRENCY_HELP, MAX_REQUESTS_HELP, THINK_HELP, _fail, _replay_options
from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype
from kvtier.commands.json_out import human_to_stderr, is_stdout, json_option, write_json_out
from kvtier.commands.size_option import cli_size
from kvtier.units import percent, ratio, seconds

console = Console()


def error_line(error: str) -> str:
    """A server's error on one line: its first line, and where the error goes on (a server's log tail),
    the last non-blank line too, which names the cause (e.g. vLLM refusing its KV space)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    if not lines:
        return "failed"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _latencies(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"--latency-ms must be comma-separated milliseconds, got {value!r}") from None


def prefetch(
    workload: Path = typer.Argument(..., help="Workload JSONL file (replayed with its own history text)."),
    out: Path = typer.Option(Path("bench-prefetch"), "--out", help="Folder for prefetch.json, the report and "
                             "one sub-folder per server."),
    json_path: Optional[Path] = json_option("the results", "OUT/prefetch.json is written as well"),
    model: Optional[str] = typer.Option(None, "--model", help="Model path (default: bundled)."),
    dtype: str = dtype_option(),
    max_concurrency: int = typer.Option(8, "--max-concurrency", "-c", help=CONCURRENCY_HELP),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale", help=THINK_HELP),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help=MAX_REQUESTS_HELP),
    kv_cache_space_gib: float = typer.Option(0.25, "--kv-cache-space-gib", min=0.001,
                                             help="vLLM's own KV space on every server (small: requests queue)."),
    max_model_len: int = typer.Option(4096, "--max-model-len", min=128, help="vLLM's max_model_len."),
    chunk_size: int = typer.Option(128, "--chunk-size", min=16, help="kvtier tokens per chunk."),
    memory_capacity: str = typer.Option("256MiB", "--memory-capacity", help="Each server's kvtier RAM tier."),
    prefetch_ram: str = typer.Option("128MiB", "--prefetch-ram", help="connector.prefetch_ram of the prefetching "
                                     "readers (part of --memory-capacity)."),
    latency_ms: str = typer.Option("0,50", "--latency-ms", help="Shared-tier latencies to measure at, "
                                   "comma-separated ms added to each read and lookup (store.faults; 0: as is)."),
    keep_shared: bool = typer.Option(False, "--keep-shared", help="Keep the shared directory."),
) -> None:
    """Returning turns' TTFT on a second replica (fresh RAM, history only in the shared tier), without and
    with queue-time prefetch, same requests; a writer replica fills the shared tier first."""
    from kvtier.bench.compare import default_model
    from kvtier.bench.prefetch_bench import PrefetchBenchOptions, run_prefetch_bench
    from kvtier.client.replay import ReplayError

    if is_stdout(json_path):
        human_to_stderr(console)
    if dtype.strip().lower() != "auto":
        dtype = resolve_cli_dtype(dtype, say=False).dtype
    opts = PrefetchBenchOptions(model=model or default_model(), dtype=dtype, kv_cache_space_gib=kv_cache_space_gib,
                                max_model_len=max_model_len, chunk_size=chunk_size,
                                ram_bytes=cli_size(memory_capacity, "--memory-capacity"),
                                prefetch_bytes=cli_size(prefetch_ram, "--prefetch-ram"),
                                latencies_ms=_latencies(latency_ms))
    try:
        opts.check()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    replay = _replay_options("closed", max_concurrency, None, 1.0, think_time_scale, max_requests, None, 0, None,
                             False, True, 300.0, True, not is_stdout(json_path), "workload")
    try:
        res = run_prefetch_bench(workload, opts, out, replay, keep_shared=keep_shared,
                                 on_event=lambda m: console.print(m, highlight=False))
    except (ReplayError, ValueError) as e:
        _fail(str(e))
    t = Table(title="returning turns: without vs with queue-time prefetch (same requests)")
    for col in ("server", "shared latency", "ok", "returning TTFT mean", "p90", "hit rate", "RAM hit tokens",
                "shared hit tokens", "load mean", "queue mean", "prefetched chunks"):
        t.add_column(col)
    for p in res.points:
        t.add_row(p.name, f"{p.latency_ms:g} ms", str(p.requests_ok), seconds(p.returning_ttft_mean_s),
                  seconds(p.returning_ttft_p90_s), percent(p.token_hit_rate), f"{p.hit_tokens_ram:,.0f}",
                  f"{p.hit_tokens_shared:,.0f}", seconds(p.load_seconds_mean), seconds(p.queue_seconds_mean),
                  ", ".join(f"{k} {v:,.0f}" for k, v in sorted(p.prefetch_chunks.items())) or "–")
    console.print(t)
    for lat, r in res.ratios.items():
        console.print(f"shared latency {lat}: returning turns' TTFT without / with prefetch: mean "
                      f"{ratio(r['returning_ttft_mean'])}, p90 {ratio(r['returning_ttft_p90'])}")
    console.print(f"report: {res.report_path}\nresults: {out / 'prefetch.json'}")
    if json_path is not None:
        write_json_out(json_path, res.to_dict())
    if res.errors:
        _fail("; ".join(f"{k}: {error_line(v)}" for k, v in res.errors.items()))


def register(app: typer.Typer) -> None:
    app.command("prefetch")(prefetch)
