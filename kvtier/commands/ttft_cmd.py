"""``kvtier bench ttft``: TTFT of vanilla vLLM, its prefix cache, kvtier (RAM, SSD) and ExampleConnector."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console

from kvtier.commands.aliases import MAX_BATCHED, aliased
from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype
from kvtier.commands.json_out import is_stdout, json_option, write_json_out

err = Console(stderr=True, soft_wrap=True)  # one line per error, never wrapped


def ttft(
    lengths: str = typer.Option(None, help="Comma-separated prompt lengths in tokens (max 8192; default "
                                "1024,4096,8192, with --slow-tier 1024, with --layerwise 2048)."),
    repeats: str = typer.Option("3", help="Distinct prompts per length (figures are medians): N, or one count "
                                "per length, e.g. 3,2,1 for 1024,4096,8192."),
    dtype: str = dtype_option(),
    model: Path = typer.Option(None, help="HF model folder (default: the bundled model)."),
    workdir: Path = typer.Option(None, help="Scratch directory for caches and engine logs "
                                 "(default: <kvtier home>/bench/ttft; wiped first)."),
    json_path: Path = json_option("the results"),
    md_path: Path = typer.Option(None, "--md", help="Write a Markdown table here."),
    example: bool = typer.Option(True, "--example/--no-example", help="Also measure vLLM's ExampleConnector."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also try vLLM's other offloading connectors "
                               "(SimpleCPUOffloadConnector, OffloadingConnector, LMCache); failures are recorded."),
    engine_timeout: float = typer.Option(1800, "--engine-timeout", help="Seconds each engine (one cache path, "
                                         "all its prompts) may run before it is stopped."),
    roles: str = typer.Option(None, help="Only these engines, comma-separated: "
                              "vanilla,kvtier-w,kvtier-r,example-w,example-r,peer:NAME (readers need their "
                              "writer)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="vLLM's engine token budget "
                                               "per step (below the prompt length = chunked prefill)."),
    sharedfs: Path = typer.Option(None, "--sharedfs", help="Add a shared-filesystem hit: this directory on a shared "
                                  "mount (written from kvtier-w's chunks)."),
    sharedfs_read: Path = typer.Option(None, "--sharedfs-read", help="The same directory through a second mount "
                                       "(the reading engine's 'machine'; default: --sharedfs)."),
    sharedfs_evict: str = typer.Option("", "--sharedfs-evict", help="Paths whose page cache is dropped before "
                                       "each shared-FS hit (e.g. JuiceFS's data directory), comma-separated."),
    valkey: str = typer.Option("", "--valkey", help="Add a Valkey/Redis hit: server URL."),
    mooncake: str = typer.Option("", "--mooncake", help="Add a Mooncake Store hit: MASTER,METADATA_URL."),
    resume: bool = typer.Option(False, "--resume", help="Keep --workdir and take roles not run now from an "
                                "earlier invocation there (a long run split into jobs)."),
    diag: bool = typer.Option(False, "--diag", help="One extra hit per kvtier role under cProfile (in --json)."),
    slow_tier: bool = typer.Option(False, "--slow-tier", help="Instead: a hit from a shared tier slowed so that "
                                   "loading takes ~2x computing, and at full speed, with claims.policy always "
                                   "and pays-off, against recompute in the same run (with --layerwise: both, "
                                   "one report)."),
    slow_latency_ms: float = typer.Option(None, "--slow-latency-ms", min=0, help="With --slow-tier: the latency "
                                          "added to every read and lookup of the slow tier (default: sized from "
                                          "the run's own recompute time)."),
    layerwise: bool = typer.Option(False, "--layerwise", help="Instead: an SSD hit of each length with a new "
                                   "--suffix, loaded whole before the forward pass and layer by layer during it, "
                                   "against load alone and suffix compute alone, in one engine (with --slow-tier: "
                                   "both, one report)."),
    suffix: int = typer.Option(256, "--suffix", min=128, max=2048, help="With --layerwise: new tokens after the "
                               "stored prefix."),
) -> None:
    """Measure TTFT (wall time of generate(max_tokens=1)) for each cache path, one engine per path."""
    lengths = lengths or ("2048" if layerwise else "1024" if slow_tier else "1024,4096,8192")
    try:
        ns = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--lengths must be comma-separated integers, got {lengths!r}") from None
    if not ns or any(n < 300 or n > 8192 for n in ns):
        raise typer.BadParameter("--lengths must each be between 300 and 8192 tokens")
    choice = resolve_cli_dtype(dtype)
    from kvtier.bench.ttft import ALL_ROLES, run_ttft
    from kvtier.bench.ttft_report import report_json, report_markdown
    from kvtier.bench.ttft_result import TtftCheckFailed, check_report
    from kvtier.bench.ttft_engine import parse_repeats

    try:
        reps = parse_repeats(repeats, ns)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    targets = shared_targets(sharedfs, sharedfs_read, sharedfs_evict, valkey, mooncake)

    role_list = None
    if roles:
        role_list = tuple(r.strip() for r in roles.split(",") if r.strip())
        bad = [r for r in role_list if r not in ALL_ROLES]
        if bad:
            raise typer.BadParameter(f"unknown roles {bad}; choose from {','.join(ALL_ROLES)}")
    from kvtier.config import kvtier_home
    from kvtier.model import default_model_path

    model = model or default_model_path()
    if not (model / "config.json").is_file():
        err.print(f"[red]model folder {model} has no config.json (run `make setup`)[/]")
        raise typer.Exit(2)
    workdir = workdir or kvtier_home() / "bench" / "ttft"
    command = "kvtier " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if slow_tier or layerwise:
        if len(set(reps.values())) != 1:
            raise typer.BadParameter(f"{'--slow-tier' if slow_tier else '--layerwise'} takes one --repeats count "
                                     "for every length")
        if layerwise:
            from kvtier.bench.ttft_engine import CHUNK
            if any(n % CHUNK for n in ns):
                raise typer.BadParameter(f"--layerwise lengths must be multiples of the {CHUNK}-token chunk")
        both = slow_tier and layerwise
        parts: dict[str, tuple[str, dict, list[str]]] = {}
        if slow_tier:
            parts["slow_tier"] = _slow_tier(model, workdir / "slow-tier" if both else workdir, ns, reps,
                                            choice.dtype, slow_latency_ms, engine_timeout, command,
                                            max_num_batched_tokens)
        if layerwise:
            parts["layerwise"] = _layerwise(model, workdir / "layerwise" if both else workdir, ns, reps,
                                            choice.dtype, suffix, engine_timeout, command, max_num_batched_tokens)
        doc = {k: d for k, (_, d, _) in parts.items()} if both else next(iter(parts.values()))[1]
        _emit("\n".join(md for md, _, _ in parts.values()), doc, json_path, md_path)
        errors = [e for _, _, es in parts.values() for e in es]
        if errors:
            err.print("[red]error: " + "; ".join(errors) + "[/]")
            raise typer.Exit(1)
        return
    report = run_ttft(str(model), workdir, ns, repeats=reps, dtype=choice.dtype, with_example=example,
                      timeout_s=engine_timeout, command=command, log=lambda m: err.print(m), roles=role_list,
                      max_batched=max_num_batched_tokens, with_peers=peers, shared=targets, resume=resume, diag=diag)
    _emit(report_markdown(report), report_json(report), json_path, md_path)
    try:
        check_report(report)
    except TtftCheckFailed as e:
        err.print(f"[red]error: {e}[/]")
        raise typer.Exit(1) from None


def _emit(md: str, doc: dict, json_path: Path | None, md_path: Path | None) -> None:
    """The report: Markdown on stdout (stderr when the JSON goes to stdout), ``--json`` and ``--md`` files."""
    print(md, file=sys.stderr if is_stdout(json_path) else sys.stdout)
    if is_stdout(json_path):
        write_json_out(json_path, doc)
    elif json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(md)


def _slow_tier(model: Path, workdir: Path, lengths: list[int], reps: dict[int, int], dtype: str,
               latency_ms: float | None, engine_timeout: float, command: str,
               max_batched: int) -> tuple[str, dict, list[str]]:
    """The slow-tier run: its Markdown, its JSON and what it found wrong (violations, crashed engines)."""
    from kvtier.bench.ttft_slow import report_json, report_markdown, run_slow_tier

    report = run_slow_tier(str(model), workdir, lengths, repeats=next(iter(reps.values())), dtype=dtype,
                           latency_ms=latency_ms, timeout_s=engine_timeout, command=command,
                           log=lambda m: err.print(m), max_batched=max_batched)
    errors = report.violations + [f"{k}: {v}" for k, v in report.crashes.items()]
    return report_markdown(report), report_json(report), errors


def _layerwise(model: Path, workdir: Path, lengths: list[int], reps: dict[int, int], dtype: str, suffix: int,
               engine_timeout: float, command: str, max_batched: int) -> tuple[str, dict, list[str]]:
    """The layerwise run: its Markdown, its JSON and its violations."""
    from kvtier.bench.ttft_layerwise import report_json, report_markdown, run_layerwise

    report = run_layerwise(str(model), workdir, lengths, suffix, repeats=next(iter(reps.values())), dtype=dtype,
                           timeout_s=engine_timeout, command=command, log=lambda m: err.print(m),
                           max_batched=max_batched)
    return report_markdown(report), report_json(report), list(report.violations)


def shared_targets(sharedfs: Path | None, sharedfs_read: Path | None, sharedfs_evict: str, valkey: str,
                   mooncake: str) -> tuple:
    """The ``SharedTarget`` of each shared backend given on the command line (validated)."""
    from kvtier.bench.shared_seed import SharedTarget
    from kvtier.config import ConfigError

    out = []
    try:
        if sharedfs is not None:
            for p, flag in ((sharedfs, "--sharedfs"), (sharedfs_read, "--sharedfs-read")):
                if p is not None and not p.is_dir():
                    raise typer.BadParameter(f"{p} is not a directory", param_hint=flag)
            base = {"kind": "sharedfs", "janitor": False}
            out.append(SharedTarget("sharedfs", {**base, "path": str(sharedfs)},
                                    {**base, "path": str(sharedfs_read or sharedfs)},
                                    tuple(x for x in sharedfs_evict.split(",") if x)))
        if valkey:
            from urllib.parse import urlsplit

            if urlsplit(valkey).password or urlsplit(valkey).username:
                raise typer.BadParameter("a URL with credentials would reach the engine's logged vLLM config; "
                                         "benchmark a server without a password", param_hint="--valkey")
            cfg = {"kind": "valkey", "url": valkey}
            out.append(SharedTarget("valkey", cfg, cfg))
        if mooncake:
            master, _, meta = mooncake.partition(",")
            if not master or not meta:
                raise typer.BadParameter("expected MASTER,METADATA_URL", param_hint="--mooncake")
            cfg = {"kind": "mooncake", "master": master, "metadata_server": meta}
            out.append(SharedTarget("mooncake", cfg, cfg))
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    return tuple(out)


def register(app: typer.Typer) -> None:
    app.command("ttft", cls=aliased(MAX_BATCHED, {"--timeout-s": "--engine-timeout"}))(ttft)
