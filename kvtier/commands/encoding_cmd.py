"""``kvtier bench encoding``: the shared-tier encodings (plain, zstd, int8) on real KV chunks: codec ratio and
speed, bytes and reads on real JuiceFS and Valkey, and int8's effect on greedy output (``kvtier.bench.encoding_bench``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console

from kvtier.commands.json_out import is_stdout, json_option, write_json_out
from kvtier.commands.size_option import cli_size

err = Console(stderr=True, soft_wrap=True)  # one line per error, never wrapped


def _csv(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def encoding(
    roles: str = typer.Option(None, "--roles", help="Only these steps, comma-separated, in their fixed order: "
                              "write-float32,write-bfloat16,codec,stores,vanilla,read-zstd,read-int8 (default: all; "
                              "readers and steps need their writers' chunks; with --resume, '' only reports)."),
    resume: bool = typer.Option(False, "--resume", help="Keep --workdir and take the steps not run now from an "
                                "earlier invocation there (a long run split into jobs)."),
    workdir: Path = typer.Option(None, help="Scratch directory for prompts, chunks, shared tiers and engine logs "
                                 "(default: <kvtier home>/bench/encoding; wiped first unless --resume)."),
    model: Path = typer.Option(None, help="HF model folder (default: the bundled model)."),
    dtypes: str = typer.Option("float32,bfloat16", "--dtypes", help="Engine dtypes whose real chunks are captured "
                               "for the codec and store figures (float32 required: the output comparison is float32)."),
    documents: int = typer.Option(50, "--documents", min=1, help="Prompts: long documents of the longdoc workload, "
                                  "one question each."),
    doc_tokens: int = typer.Option(1400, "--doc-tokens", min=16, help="Median document length in tokens."),
    spread: float = typer.Option(0.3, "--spread", min=0.0, max=0.99, help="Document lengths uniform in "
                                 "doc-tokens*(1 +- spread)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the documents."),
    max_output_tokens: int = typer.Option(64, "--max-output-tokens", min=1, help="Greedy tokens generated per "
                                          "prompt by the reference and each reader."),
    volume: str = typer.Option("256MiB", "--volume", help="Plain KV bytes per dtype in each store pass."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Store rounds (figures are medians)."),
    valkey: str = typer.Option("", "--valkey", help="Valkey/Redis URL for the store figures (default: start a "
                               "local throwaway server)."),
    sharedfs: Path = typer.Option(None, "--sharedfs", help="Directory on a shared mount for the store figures "
                                  "(default: start a local JuiceFS volume)."),
    sharedfs_read: Path = typer.Option(None, "--sharedfs-read", help="The same directory through a second mount "
                                       "(reads come from there: 'the other machine')."),
    engine_timeout: float = typer.Option(900, "--engine-timeout", min=1, help="Seconds each engine may run "
                                         "before it is stopped."),
    json_path: Path = json_option("the results"),
    md_path: Path = typer.Option(None, "--md", help="Write a Markdown report here."),
) -> None:
    """Measure the shared-tier encodings on real KV of the model: ratio and codec speed per dtype, bytes
    stored and reads on real stores, and int8 against float32 recompute (zstd must be token-exact)."""
    from kvtier.bench.encoding_bench import EncodingOptions, run_encoding
    from kvtier.bench.encoding_report import report_markdown
    from kvtier.config import kvtier_home
    from kvtier.model import default_model_path

    vol = cli_size(volume, "--volume")
    for p, flag in ((sharedfs, "--sharedfs"), (sharedfs_read, "--sharedfs-read")):
        if p is not None and not p.is_dir():
            raise typer.BadParameter(f"{p} is not a directory", param_hint=flag)
    model = model or default_model_path()
    opts = EncodingOptions(model=str(model), workdir=workdir or kvtier_home() / "bench" / "encoding",
                           documents=documents, doc_tokens=doc_tokens, spread=spread, seed=seed,
                           max_output_tokens=max_output_tokens, dtypes=_csv(dtypes), volume=vol, repeats=repeats,
                           roles=_csv(roles) if roles is not None else None, resume=resume,
                           engine_timeout=engine_timeout, valkey=valkey, sharedfs=sharedfs, sharedfs_read=sharedfs_read,
                           command="kvtier " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    try:
        opts.check()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if not (model / "config.json").is_file():
        err.print(f"[red]error: model folder {model} has no config.json (run `make setup`)[/]")
        raise typer.Exit(2)
    try:
        report = run_encoding(opts, log=lambda m: err.print(m, markup=False, highlight=False))
    except ValueError as e:                 # e.g. a --resume workdir holding other prompts
        err.print(f"error: {e}", style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None
    md = report_markdown(report)
    print(md, file=sys.stderr if is_stdout(json_path) else sys.stdout)
    if json_path is not None:
        write_json_out(json_path, report.to_json())
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(md)
    if report.violations:
        err.print("error: " + "; ".join(report.violations[:5]), style="red", markup=False, highlight=False)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("encoding")(encoding)

