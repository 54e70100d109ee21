"""``kvtier bench run|slo|compare``: replay a workload, search an SLO, compare server configurations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvtier.commands.aliases import BASE_URL, LOAD, REPLAY, aliased
from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype
from kvtier.commands.json_out import human_to_stderr, is_stdout, json_option, write_json_out
from kvtier.units import num_s, percent, ratio

console = Console()
err_console = Console(stderr=True)

MODES = ("closed", "open", "trace")
HISTORY_HELP = ("Assistant messages in each prompt: 'workload' (the workload's text: identical prompts for "
                "every server) or 'live' (the model's own streamed replies to the earlier turns, as a real chat "
                "client sends; text turns only).")
BASE_URL_HELP = "Server root, e.g. http://127.0.0.1:8000 (as vLLM's `bench serve --base-url`)."
MODE_HELP = "closed (N users), open (Poisson rate) or trace (the workload's arrival_s)."
CONCURRENCY_HELP = "Closed loop: concurrent users (conversations in flight)."
RATE_HELP = "Open loop: new conversations per second (Poisson arrivals)."
TIME_SCALE_HELP = "Trace mode: multiply arrival timestamps."
THINK_HELP = "Multiply think times (0: none)."
MAX_REQUESTS_HELP = "Stop after this many requests."
DURATION_HELP = "Stop sending after this many seconds."
SEED_HELP = "Open loop: arrival seed."
REQUEST_TIMEOUT_HELP = "Per-request timeout (s)."


def _fail(msg: str, code: int = 1) -> None:
    err_console.print(f"[red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _replay_options(mode: str, max_concurrency: int, request_rate: Optional[float], time_scale: float,
                    think_time_scale: float, max_requests: Optional[int], duration: Optional[float], seed: int,
                    model: Optional[str], skip_bad_lines: bool, stop_on_connect_error: bool,
                    request_timeout: float, ignore_eos: bool, progress: bool, history: str = "workload"):
    from kvtier.client.stream import ClientOptions
    from kvtier.client.replay import ReplayError, ReplayOptions

    if mode not in MODES:
        raise typer.BadParameter(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if history not in ("live", "workload"):
        raise typer.BadParameter(f"--history must be live or workload, got {history!r}")
    opts = ReplayOptions(mode=mode, history=history, concurrency=max_concurrency, rate=request_rate,
                         time_scale=time_scale, think_time_scale=think_time_scale, max_requests=max_requests,
                         duration_s=duration, seed=seed, model=model, skip_bad_lines=skip_bad_lines,
                         stop_on_connect_error=stop_on_connect_error, progress=progress,
                         client=ClientOptions(request_timeout_s=request_timeout, ignore_eos=ignore_eos))
    try:
        opts.validate()
    except ReplayError as e:
        raise typer.BadParameter(str(e)) from None
    return opts


def _s(v: Any) -> str:
    if v is None:
        return "–"
    return num_s(v) if isinstance(v, float) else str(v)


def print_summary(summary: dict[str, Any], title: str = "replay") -> None:
    t = Table(title=title, show_header=False)
    t.add_row("requests ok / failed", f"{summary['requests_ok']} / {summary['requests_failed']}"
              + (f"  {summary['errors_by_kind']}" if summary["errors_by_kind"] else ""))
    t.add_row("stopped", str(summary.get("stopped_reason")))
    t.add_row("history", str(summary.get("history", "workload"))
              + (f" ({summary['requests_with_history_fallback']} requests carried a failed turn's workload text)"
                 if summary.get("requests_with_history_fallback") else ""))
    t.add_row("duration (s)", _s(summary["duration_s"]))
    t.add_row("TTFT mean / p50 / p90 / p99 / max (s)", " / ".join(
        _s(summary[f"ttft_{k}_s"]) for k in ("mean", "p50", "p90", "p99", "max")))
    t.add_row("TTFT first turn / later turns (s)",
              f"{_s(summary['first_turn']['ttft_mean_s'])} / {_s(summary['later_turns']['ttft_mean_s'])}")
    t.add_row("token hit rate (all / last half)",
              f"{percent(summary['token_hit_rate'])} / {percent(summary['token_hit_rate_last_half'])}")
    server = summary.get("server") or {}
    t.add_row("server prefix-cache hit rate", percent(server.get("prefix_cache_hit_rate")))
    t.add_row("server TTFT mean (s) / client÷server", f"{_s(server.get('ttft_mean_s'))} / "
              f"{ratio(summary.get('client_over_server_ttft'))}")
    console.print(t)


def run(
    workload: Path = typer.Argument(..., help="Workload JSONL file."),
    base_url: str = typer.Option(..., "--base-url", help=BASE_URL_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Model name (default: first of /v1/models)."),
    mode: str = typer.Option("closed", "--mode", help=MODE_HELP),
    max_concurrency: int = typer.Option(4, "--max-concurrency", "-c", help=CONCURRENCY_HELP),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help=RATE_HELP),
    time_scale: float = typer.Option(1.0, "--time-scale", help=TIME_SCALE_HELP),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale", help=THINK_HELP),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help=MAX_REQUESTS_HELP),
    duration: Optional[float] = typer.Option(None, "--duration", help=DURATION_HELP),
    seed: int = typer.Option(0, "--seed", help=SEED_HELP),
    out: Path = typer.Option(Path("bench-out"), "--out", help="Folder for requests.jsonl and summary.json."),
    json_path: Optional[Path] = json_option("the summary", "a path replaces OUT/summary.json"),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip malformed workload lines instead of stopping."),
    stop_on_connect_error: bool = typer.Option(True, "--stop-on-connect-error/--record-connect-errors",
                                               help="Stop at the first connection failure, or record and go on."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help=REQUEST_TIMEOUT_HELP),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Decode exactly max_tokens (vLLM)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar while replaying."),
    history: str = typer.Option("workload", "--history", help=HISTORY_HELP),
) -> None:
    """Replay WORKLOAD against a running OpenAI-compatible server and summarize latency and hit rate."""
    from kvtier.client.replay import ReplayError, run_replay

    to_stdout = is_stdout(json_path)
    if to_stdout:
        human_to_stderr(console)
    opts = _replay_options(mode, max_concurrency, request_rate, time_scale, think_time_scale, max_requests,
                           duration, seed, model, skip_bad_lines, stop_on_connect_error, request_timeout,
                           ignore_eos, progress and not to_stdout, history)
    try:
        result = run_replay(workload, base_url, opts, out, None if to_stdout else json_path)
    except ReplayError as e:
        _fail(str(e))
    print_summary(result.summary, f"replay of {workload.name} ({mode}, {history} history)")
    console.print(f"records: {result.records_path}\nsummary: {result.summary_path}")
    if to_stdout:
        write_json_out(json_path, result.summary)


def slo(
    workload: Path = typer.Argument(..., help="Workload JSONL file."),
    base_url: str = typer.Option(..., "--base-url", help=BASE_URL_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Model name (default: first of /v1/models)."),
    mode: str = typer.Option("closed", "--mode", help="closed: search users; open: search conversations/s."),
    slo_s: float = typer.Option(2.0, "--slo", help="Latency objective in seconds."),
    statistic: str = typer.Option("ttft_p90_s", "--statistic", help="Summary key compared with the SLO."),
    start: float = typer.Option(1.0, "--start", help="First load (users or conversations/s)."),
    max_load: float = typer.Option(256.0, "--max-load", help="Largest load tried."),
    repeats: int = typer.Option(1, "--repeats", help="Runs per point (median of the statistic)."),
    requests_per_point: Optional[int] = typer.Option(None, "--requests-per-point",
                                                     help="Requests per run (default max(16, 4 x load))."),
    think_time_scale: float = typer.Option(0.0, "--think-time-scale", help="Multiply think times (default 0)."),
    out: Path = typer.Option(Path("bench-slo"), "--out", help="Folder for slo.json, each point's runs and the plot."),
    json_path: Optional[Path] = json_option("the SLO result", "OUT/slo.json is written as well"),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help=REQUEST_TIMEOUT_HELP),
    history: str = typer.Option("workload", "--history", help=HISTORY_HELP),
) -> None:
    """Find the largest load whose latency statistic stays within the SLO (doubling, then bisection)."""
    from kvtier.client.replay import ReplayError, load_conversations, write_json
    from kvtier.bench.report import RunView, plot_slo_curve
    from kvtier.client.slo import SloOptions, run_slo

    if is_stdout(json_path):
        human_to_stderr(console)
    if mode not in ("closed", "open"):
        raise typer.BadParameter("--mode must be closed or open for an SLO search")
    opts = _replay_options(mode, 1, start if mode == "open" else None, 1.0, think_time_scale, None, None, 0, model,
                           False, True, request_timeout, True, False, history)
    sopts = SloOptions(slo_s=slo_s, statistic=statistic, start=start, max_load=max_load, repeats=repeats,
                       requests_per_point=requests_per_point)
    try:
        sopts.validate(mode)
        convs, _ = load_conversations(workload, False)
    except ReplayError as e:
        raise typer.BadParameter(str(e)) from None

    def on_point(p) -> None:
        mark = "[green]pass[/]" if p.passed else "[red]fail[/]"
        console.print(f"load {p.load:g}: {statistic} = {_s(p.value)} s, failed requests {p.failed_requests} {mark}")

    try:
        result = run_slo(convs, base_url, opts, sopts, out, on_point)
    except ReplayError as e:
        _fail(str(e))
    t = Table(title=f"SLO search: {statistic} <= {slo_s:g} s")
    for col in ("load", statistic, "repeats", "failed", "pass"):
        t.add_column(col)
    for p in result.points:
        t.add_row(f"{p.load:g}", _s(p.value), ", ".join(_s(v) for v in p.values), str(p.failed_requests),
                  "yes" if p.passed else "no")
    console.print(t)
    best = "none (the first load already fails)" if result.best_load is None else f"{result.best_load:g}"
    console.print(f"best {'users' if mode == 'closed' else 'rate'}: {best}"
                  + (" (capped by --max-load)" if result.capped else ""))
    plot = plot_slo_curve([RunView(base_url, None, slo=result)], out / "slo_curve.png")
    if is_stdout(json_path):
        write_json_out(json_path, result.to_dict())
    elif json_path:
        write_json(json_path, result.to_dict())
    console.print(f"result: {out / 'slo.json'}" + (f"\nplot: {plot}" if plot else ""))


def compare(
    workload: Path = typer.Argument(..., help="Workload JSONL file."),
    configs: Path = typer.Option(..., "--configs", help="YAML list of server configurations (first = baseline)."),
    out: Path = typer.Option(Path("bench-compare"), "--out", help="Folder for the report, compare.json and "
                             "one sub-folder per configuration."),
    json_path: Optional[Path] = json_option("the comparison", "OUT/compare.json is written as well"),
    model: Optional[str] = typer.Option(None, "--model", help="Model path for entries without one (default: bundled)."),
    mode: str = typer.Option("closed", "--mode", help=MODE_HELP),
    max_concurrency: int = typer.Option(4, "--max-concurrency", "-c", help=CONCURRENCY_HELP),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help=RATE_HELP),
    time_scale: float = typer.Option(1.0, "--time-scale", help=TIME_SCALE_HELP),
    think_time_scale: float = typer.Option(1.0, "--think-time-scale", help=THINK_HELP),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help=MAX_REQUESTS_HELP),
    duration: Optional[float] = typer.Option(None, "--duration", help=DURATION_HELP),
    seed: int = typer.Option(0, "--seed", help=SEED_HELP),
    slo_s: Optional[float] = typer.Option(None, "--slo", help="Also run an SLO search per configuration "
                                          "(p90 TTFT objective in seconds)."),
    slo_max_load: float = typer.Option(64.0, "--slo-max-load", help="Largest load the SLO search tries."),
    keep_disk: bool = typer.Option(False, "--keep-disk", help="Keep the fresh disk-tier directories."),
    ready_timeout: float = typer.Option(240.0, "--ready-timeout", help="Seconds to wait for each server to be ready."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help=REQUEST_TIMEOUT_HELP),
    dtype: str = dtype_option(),
    history: str = typer.Option("workload", "--history", help=HISTORY_HELP),
) -> None:
    """Run WORKLOAD against each configuration on a fresh vLLM server; write a report with plots."""
    from kvtier.bench.compare import compare_json, load_compare_specs, run_compare
    from kvtier.client.replay import ReplayError
    from kvtier.client.slo import SloOptions
    from kvtier.config import ConfigError

    if is_stdout(json_path):
        human_to_stderr(console)
    opts = _replay_options(mode, max_concurrency, request_rate, time_scale, think_time_scale, max_requests,
                           duration, seed, None, False, True, request_timeout, True, not is_stdout(json_path),
                           history)
    if dtype.strip().lower() != "auto":
        dtype = resolve_cli_dtype(dtype, say=False).dtype   # validated; each server says its choice at start
    try:
        specs = load_compare_specs(configs, model, dtype=dtype)
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    slo_opts = SloOptions(slo_s=slo_s, max_load=slo_max_load) if slo_s else None
    try:
        result = run_compare(workload, specs, out, opts, slo=slo_opts, keep_disk=keep_disk,
                             ready_timeout_s=ready_timeout, on_event=lambda m: console.print(m, highlight=False))
    except ReplayError as e:
        _fail(str(e))
    for r in result.runs:
        if r.summary:
            print_summary(r.summary, r.name)
    console.print(json.dumps(result.speedups, indent=1))
    console.print(f"report: {result.report_path}\nsummary: {result.summary_path}")
    if json_path is not None:
        write_json_out(json_path, compare_json(result))
    if any(r.error for r in result.runs):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("run", cls=aliased(REPLAY))(run)
    app.command("slo", cls=aliased(BASE_URL))(slo)
    app.command("compare", cls=aliased(LOAD))(compare)
