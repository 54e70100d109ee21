"""The ``kvtier`` command line (typer + rich).

Commands live beside the code they drive; each command module exposes
``register(app)`` and is imported here lazily enough that ``kvtier --help`` never
imports torch or vLLM.
"""

from __future__ import annotations

import importlib

import typer

from kvtier import __version__

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kvtier: tiered KV cache (RAM -> SSD -> shared store) for vLLM, and the lab that measures it.")
workload_app = typer.Typer(no_args_is_help=True, help="Generate, import and inspect workloads.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: store, ttft, prefetch, replay, slo, compare.")
app.add_typer(workload_app, name="workload")
app.add_typer(bench_app, name="bench")

# (module, group) — group is None for top-level commands.
COMMAND_MODULES: tuple[tuple[str, str | None], ...] = (
    ("kvtier.commands.doctor_cmd", None),     # doctor
    ("kvtier.commands.basic", None),          # generate
    ("kvtier.commands.demo_cmd", None),       # demo (= demo companion), demo longdoc, demo slo
    ("kvtier.commands.workload_cmd", "workload"),  # companion, longdoc, import, stats
    ("kvtier.commands.bench_cmd", "bench"),        # run, slo, compare
    ("kvtier.commands.store_cmd", None),           # fsck, bench store
    ("kvtier.commands.serve_cmd", None),           # serve (vLLM + kvtier connector)
    ("kvtier.commands.stats_cmd", None),           # stats (connector/store metrics)
    ("kvtier.commands.ttft_cmd", "bench"),         # bench ttft
    ("kvtier.commands.encoding_cmd", "bench"),     # bench encoding
    ("kvtier.commands.prefetch_cmd", "bench"),     # bench prefetch
    ("kvtier.commands.sim_cmd", None),             # simulate, plan, calibrate
)

_GROUPS = {None: app, "workload": workload_app, "bench": bench_app}


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvtier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print kvtier's version and exit.")) -> None:
    """kvtier: tiered KV cache (RAM -> SSD -> shared store) for vLLM, and the lab that measures it."""


def _register_all() -> None:
    for module_name, group in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.register(_GROUPS[group])


def main() -> None:
    _register_all()
    app()


if __name__ == "__main__":
    main()
