"""``kvtier serve [MODEL] [vLLM args...]``: vLLM's OpenAI server with the kvtier connector, like ``vllm serve``.

``kvtier serve Qwen/Qwen2.5-7B-Instruct --memory-capacity 8GiB --disk-path /mnt/nvme/kvtier --max-model-len 8192``
runs ``python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B-Instruct --kv-transfer-config
{...kvtier_config_file...} --max-model-len 8192``. MODEL is a Hugging Face id or a local folder (the
bundled model when omitted) and must come first; every argument kvtier does not know (and everything
after ``--``) goes to vLLM unchanged.

Contracts:
- The kvtier config is ``--config`` (else ``$KVTIER_CONFIG_FILE``) <- ``KVTIER_*`` env <- the tier
  flags; it is written, without secrets, to a YAML file under ``<kvtier home>/serve/`` that vLLM's
  connector reads (``kvtier_config_file``); secrets reach vLLM through its environment only.
- On vLLM's CPU backend the CPU rules apply: ``--dtype`` (auto: ``kvtier.compute.choose_dtype``) and
  ``--enforce-eager`` are always passed. On any other backend only a ``--dtype`` the user gave is.
- ``--host``/``--port`` are passed only when given (vLLM's default: all interfaces, port 8000).
  A server reachable from the network without ``--api-key`` is warned about, never refused.
- Metrics are on: the scheduler's kvtier metrics on ``--metrics-port`` (default 9400), worker rank r
  on +1+r, bound where the API binds unless ``metrics.host`` is configured; 0 turns them off.
- ``--dry-run`` writes the config file, prints the shell-quoted command on stdout and what it wrote
  on stderr; it starts nothing and never imports vLLM. A real run replaces this process (exec).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import typer
from rich.console import Console

from kvtier.commands.aliases import aliased
from kvtier.commands.dtype_option import HELP as DTYPE_HELP
from kvtier.commands.serve_launch import (CPU_BLOCK_SIZE, DEFAULT_METRICS_PORT, GPU_BLOCK_SIZE, build_argv,
                                          cpu_backend, env_prefix, flag_value, has_flag, launch_env, pop_flag,
                                          public_config, write_config_file)
from kvtier.commands.size_option import cli_size

err = Console(stderr=True, soft_wrap=True, highlight=False)  # one line per message, never wrapped

ALIASES = {"--ram": "--memory-capacity", "--disk": "--disk-path"}
ALL_INTERFACES = "0.0.0.0"
_OWNED = ("--model", "--kv-transfer-config")   # set by kvtier serve; refused in the pass-through


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error: {message}[/]")
    return typer.Exit(2)


def _overrides(memory_capacity: str | None, disk_path: Path | None, disk_capacity: str | None,
               chunk_size: int | None, metrics_port: int | None) -> dict:
    store: dict = {}
    cap = cli_size(memory_capacity, "--memory-capacity")
    if cap is not None:
        store["memory"] = {"enabled": cap > 0, "capacity": cap}
    if disk_path is not None:
        store["disk"] = {"enabled": True, "path": str(disk_path)}
    dcap = cli_size(disk_capacity, "--disk-capacity")
    if dcap is not None:
        store.setdefault("disk", {})["capacity"] = dcap
    if chunk_size is not None:
        store["chunk_size"] = chunk_size
    out: dict = {"store": store} if store else {}
    if metrics_port is not None:
        out["metrics"] = {"port": metrics_port}
    return out


def _split_model(model: str | None, model_opt: str | None, args: list[str]) -> tuple[str | None, list[str]]:
    """MODEL is the first word kvtier does not know; a word that is an option belongs to vLLM."""
    passthrough = list(args)
    if model is not None and model.startswith("-"):
        passthrough, model = [model, *passthrough], None
    if model_opt is not None:
        err.print("note: --model is deprecated; give the model first: kvtier serve MODEL")
        if model is not None and model != model_opt:
            raise _fail(f"two models given: {model} and --model {model_opt}")
        model = model_opt
    return model, passthrough


def _metrics_endpoint(metrics, api_host: str | None) -> dict:
    """Metrics on by default: metrics.port unset -> DEFAULT_METRICS_PORT, 0 -> off (None); bound where
    the API binds (all interfaces by default) unless metrics.host was configured."""
    port = DEFAULT_METRICS_PORT if metrics.port is None else (metrics.port or None)
    host = metrics.host if "host" in metrics.model_fields_set else (api_host or ALL_INTERFACES)
    return {"port": port, "host": host}


def _disk_problem(path: Path, create: bool) -> str | None:
    """Why the SSD tier directory cannot be used (None: fine). ``create``: make it now."""
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot create store.disk.path {path}: {e.strerror}"
        return None
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"cannot create store.disk.path {path}: {probe} is not a directory"
    return None


def serve(
    ctx: typer.Context,
    model: str = typer.Argument(None, metavar="MODEL", show_default=False,
                                help="Hugging Face model id (Qwen/Qwen2.5-7B-Instruct) or local folder; default: "
                                     "the bundled model. Arguments after it go to vLLM."),
    config: Path = typer.Option(None, "--config", metavar="FILE", help="kvtier YAML config (default: "
                                "$KVTIER_CONFIG_FILE; KVTIER_* env applies on top). vLLM's own --config: after --."),
    memory_capacity: str = typer.Option(None, "--memory-capacity", metavar="SIZE",
                                        help="RAM tier capacity, e.g. 4GiB (0 disables the RAM tier)."),
    disk_path: Path = typer.Option(None, "--disk-path", metavar="DIR", help="Enable the SSD tier in this directory."),
    disk_capacity: str = typer.Option(None, "--disk-capacity", metavar="SIZE", help="SSD tier capacity, e.g. 100GiB."),
    chunk_size: int = typer.Option(None, "--chunk-size", help="Tokens per chunk (a multiple of the block size)."),
    metrics_port: int = typer.Option(None, "--metrics-port", help=f"kvtier metrics port of the scheduler "
                                     f"(workers on +1, +2, ...); default metrics.port or {DEFAULT_METRICS_PORT}; "
                                     "0 turns them off."),
    host: str = typer.Option(None, "--host", help="Address vLLM binds (default: vLLM's, all interfaces)."),
    port: int = typer.Option(None, "--port", help="vLLM's API port (default: vLLM's, 8000)."),
    dtype: str = typer.Option(None, "--dtype", help=DTYPE_HELP + " Default: auto on vLLM's CPU backend, "
                              "vLLM's own default elsewhere."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the config file and print the vLLM command; "
                                 "start nothing."),
    model_opt: str = typer.Option(None, "--model", hidden=True, help="Deprecated: give MODEL first."),
) -> None:
    """Start vLLM's OpenAI server with kvtier: kvtier serve MODEL, then any of vLLM's own arguments."""
    from kvtier.config import ConfigError, config_file, deep_merge, kvtier_home, load_config

    model, passthrough = _split_model(model, model_opt, list(ctx.args))
    for flag in _OWNED:
        if has_flag(passthrough, flag):
            raise _fail(f"{flag} is set by kvtier serve; give the model first and the kvtier config with --config")
    given_dtype, passthrough = pop_flag(passthrough, "--dtype")   # `-- --dtype X`: the same request
    if given_dtype is not None and dtype is not None and given_dtype != dtype:
        raise _fail(f"--dtype given twice ({dtype} and {given_dtype})")
    dtype = dtype if dtype is not None else given_dtype
    late_host, passthrough = pop_flag(passthrough, "--host")    # `-- --host X` is the same request
    late_port, passthrough = pop_flag(passthrough, "--port")
    host = late_host if late_host is not None else host
    if late_port is not None:
        if not late_port.isdigit():
            raise _fail(f"--port {late_port} is not a port number")
        port = int(late_port)

    source = config_file(config)
    overrides = _overrides(memory_capacity, disk_path, disk_capacity, chunk_size, metrics_port)
    try:
        cfg = load_config(source, overrides=overrides)
        metrics = _metrics_endpoint(cfg.metrics, host)
        if metrics != {"port": cfg.metrics.port, "host": cfg.metrics.host}:
            cfg = load_config(source, overrides=deep_merge(overrides, {"metrics": metrics}))
    except ConfigError as e:
        raise _fail(str(e)) from None
    if disk_capacity is not None and not cfg.store.disk.enabled:
        raise _fail("--disk-capacity needs the SSD tier: give --disk-path or store.disk in --config")
    if cfg.store.disk.enabled and cfg.store.disk.path is not None:
        problem = _disk_problem(Path(cfg.store.disk.path), create=not dry_run)
        if problem:
            raise _fail(problem)

    cpu = cpu_backend()
    local = model is None or model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()
    if model is None:
        from kvtier.model import default_model_path
        model = str(default_model_path())
    if local and not dry_run:        # --dry-run only prints the command
        from kvtier.model import model_folder_problem
        problem = model_folder_problem(Path(model).expanduser())
        if problem:
            raise _fail(problem)
    if cpu:
        from kvtier.commands.dtype_option import resolve_cli_dtype
        dtype = resolve_cli_dtype(dtype or "auto").dtype
    block = flag_value(passthrough, "--block-size")
    block_size = int(block) if block and block.isdigit() else (CPU_BLOCK_SIZE if cpu else GPU_BLOCK_SIZE)
    if cfg.store.chunk_size % block_size:
        why = "--block-size" if block else f"vLLM's default{' on CPU' if cpu else ''}"
        raise _fail(f"store.chunk_size={cfg.store.chunk_size} must be a multiple of the engine block size "
                    f"{block_size} ({why})")

    public, secret_env = public_config(cfg)
    path = write_config_file(public, kvtier_home() / "serve", str(source) if source else "defaults",
                             sorted(secret_env))
    argv = build_argv(model, path, passthrough, cpu=cpu, dtype=dtype, host=host, port=port)
    env = launch_env(secret_env, cpu=cpu, local_model=local, passthrough=passthrough)
    _warn_exposure(host, port, passthrough, cfg.metrics.host, cfg.metrics.port)
    err.print(f"kvtier serve: config written to {path}")
    if dry_run:
        missing = [k for k in sorted(secret_env) if os.environ.get(k) != secret_env[k]]
        if missing:
            err.print(f"kvtier serve: secrets are not in the file or the command; set {', '.join(missing)} "
                      "in vLLM's environment")
        print(shlex.join(env_prefix(env, os.environ, hide=list(secret_env)) + argv))
        return
    os.execvpe(argv[0], argv, env)


def _warn_exposure(host: str | None, port: int | None, passthrough: list[str], metrics_host: str,
                   metrics_port: int | None) -> None:
    from kvtier.security import is_loopback

    where = f"{host}:{port or 8000}" if host else f"port {port or 8000} on all interfaces"
    authed = has_flag(passthrough, "--api-key") or bool(os.environ.get("VLLM_API_KEY"))
    if (host is None or not is_loopback(host)) and not authed:
        err.print(f"[yellow]kvtier serve: vLLM listens on {where} without --api-key: the API is reachable from "
                  "the network (--host 127.0.0.1 keeps it local)[/]")
    if metrics_port:
        err.print(f"kvtier serve: kvtier metrics on {metrics_host}:{metrics_port} (scheduler) and "
                  f"{metrics_port + 1}+ (workers); `kvtier stats --base-url http://HOST:{port or 8000}` merges them")


def register(app: typer.Typer) -> None:
    app.command("serve", cls=aliased(ALIASES),
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
