"""``kvtier stats``: connector + store metrics from a running server or from a cache directory.

Sources (merged: ``kvtier.commands.stats_sources.merge``):
- ``kvtier stats --base-url http://host:8000``: the vLLM server's kvtier processes, found by
  ``stats_sources.discover`` (the scheduler on ``metrics.port``, default 9400 under ``kvtier serve``,
  worker rank r on ``metrics.port + 1 + r``), plus vLLM's own prefix-cache counters from its
  ``/metrics``; a URL ending in ``/metrics`` is read as that one endpoint. Repeatable.
- ``kvtier stats DIR``: the JSON snapshots the connector processes write to ``DIR/_stats``
  (or DIR itself if it holds them): ``<role>-<pid>.json``, refreshed every few seconds.
``--json PATH`` writes the merged samples (``-``: stdout, the tables then go to stderr).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvtier.commands.aliases import BASE_URL, JSON_SWITCH, aliased
from kvtier.commands.json_out import is_stdout, json_option, write_json_out
from kvtier.commands.stats_sources import Source, SourceError, discover, merge

err = Console(stderr=True, soft_wrap=True, highlight=False)  # one line per error, never wrapped
DEFAULT_METRICS_PORT = 9400     # kvtier serve's default metrics.port

_SUMMARY = [
    ("lookups", "kvtier_connector_lookups_total"),
    ("prompt tokens looked up", "kvtier_connector_lookup_tokens_total"),
    ("hit tokens claimed", "kvtier_connector_hit_tokens_total"),
    ("tokens loaded", "kvtier_connector_loaded_tokens_total"),
    ("bytes loaded", "kvtier_connector_load_bytes_total"),
    ("chunks stored", "kvtier_connector_stored_chunks_total"),
    ("bytes stored", "kvtier_connector_store_bytes_total"),
    ("stores dropped", "kvtier_connector_dropped_stores_total"),
    ("connector errors", "kvtier_connector_errors_total"),
    ("store events", "kvtier_events_total"),
]


def snapshot_files(directory: Path) -> list[Path]:
    d = directory / "_stats" if (directory / "_stats").is_dir() else directory
    return sorted(p for p in d.glob("*.json") if not p.name.startswith("."))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def from_directory(directory: Path, live_only: bool) -> tuple[dict[str, float], list[dict]]:
    docs = []
    for p in snapshot_files(directory):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        doc["alive"] = _pid_alive(int(doc.get("pid", -1)))
        doc["file"] = p.name
        if live_only and not doc["alive"]:
            continue
        docs.append(doc)
    return merge([d.get("samples", {}) for d in docs]), docs


def total(samples: dict[str, float], name: str) -> tuple[float, dict[str, float]]:
    """Sum of a metric over its labels, and the per-label-set values."""
    per = {k[len(name):].strip("{}"): v for k, v in samples.items() if k == name or k.startswith(name + "{")}
    return sum(per.values()), per


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**20:.1f} MiB"


def _sources_table(docs: list[dict], sources: list[Source]) -> Table:
    src = Table(title="sources")
    for c in ("source", "role", "state"):
        src.add_column(c)
    for d in docs:
        src.add_row(d["file"], d.get("role", "?"), ("alive" if d["alive"] else "exited") +
                    f", {time.time() - d.get('time', 0):.0f} s old")
    for s in sources:
        src.add_row(s.url, s.role, f"{len(s.samples)} samples")
    return src


def _kvtier_table(samples: dict[str, float]) -> Table:
    table = Table(title="kvtier")
    table.add_column("metric")
    table.add_column("total", justify="right")
    table.add_column("by label")
    for label, name in _SUMMARY:
        t, per = total(samples, name)
        detail = ", ".join(f"{k}: {v:g}" for k, v in per.items() if k) if len(per) > 1 or "" not in per else ""
        table.add_row(label, f"{t:,.0f}", detail)
    for name, label in (("kvtier_connector_load_seconds", "load latency"),
                        ("kvtier_connector_save_seconds", "save latency")):
        n, _ = total(samples, name + "_count")
        s, _ = total(samples, name + "_sum")
        table.add_row(label + " (mean)", f"{(s / n * 1e3) if n else 0:.2f} ms", f"n={n:g}")
    claimed, _ = total(samples, "kvtier_connector_hit_tokens_total")
    looked, _ = total(samples, "kvtier_connector_lookup_tokens_total")
    if looked:
        table.add_row("token hit rate", f"{claimed / looked:.1%}", "")
    _, used = total(samples, "kvtier_tier_usage_bytes")
    _, cap = total(samples, "kvtier_tier_capacity_bytes")
    if cap:
        table.add_row("tier usage", "", ", ".join(f"{k.removeprefix('tier=')}: {_size(used.get(k, 0))} of {_size(v)}"
                                                  for k, v in sorted(cap.items())))
    q, h = samples.get("vllm:prefix_cache_queries_total"), samples.get("vllm:prefix_cache_hits_total")
    if q:
        table.add_row("vLLM prefix cache hit rate", f"{(h or 0) / q:.1%}", f"{q:,.0f} tokens queried")
    q, h = samples.get("vllm:external_prefix_cache_queries_total"), samples.get("vllm:external_prefix_cache_hits_total")
    if q:
        table.add_row("vLLM external (kvtier) hit rate", f"{(h or 0) / q:.1%}", f"{q:,.0f} tokens queried")
    return table


def stats(
    directory: Path = typer.Argument(None, metavar="DIR", show_default=False,
                                     help="Disk tier directory (or its _stats folder) to read snapshots from."),
    base_url: list[str] = typer.Option(None, "--base-url", metavar="URL", help="vLLM server (http://host:8000): "
                                       "its scheduler's and workers' kvtier metrics are found and merged; a URL "
                                       "ending in /metrics is read as it is. Repeatable."),
    metrics_port: int = typer.Option(DEFAULT_METRICS_PORT, "--metrics-port", help="The server's kvtier "
                                     "metrics.port (scheduler; workers on +1, +2, ...)."),
    live_only: bool = typer.Option(False, help="Ignore snapshots of processes that have exited."),
    json_out: str = json_option("the merged samples"),
) -> None:
    """Print kvtier's connector and store metrics, merged over the scheduler and every worker."""
    if directory is None and not base_url:
        raise typer.BadParameter("give a cache DIRECTORY or a server --base-url")
    console = Console(stderr=is_stdout(json_out))   # per call: stdout carries only the `--json -` document
    merged: list[dict[str, float]] = []
    docs: list[dict] = []
    sources: list[Source] = []
    if directory is not None:
        if not directory.is_dir():
            raise typer.BadParameter(f"{directory} is not a directory")
        s, docs = from_directory(directory, live_only)
        if not docs:
            err.print(f"[red]no kvtier stats snapshots under {directory}[/]")
            raise typer.Exit(1)
        merged.append(s)
    for u in base_url or []:
        try:
            found, vllm = discover(u, metrics_port)
        except SourceError as e:
            err.print(f"[red]error: {e}[/]")
            raise typer.Exit(1)
        sources += found
        merged += [s.samples for s in found] + [vllm]
    samples = merge(merged)
    if json_out is not None:
        write_json_out(json_out, dict(sorted(samples.items())))
    if docs or sources:
        console.print(_sources_table(docs, sources))
    console.print(_kvtier_table(samples))


def register(app: typer.Typer) -> None:
    app.command("stats", cls=aliased(BASE_URL, JSON_SWITCH))(stats)
