"""``kvtier stats``: connector + store metrics from a running server or from a cache directory.

Sources (merged by summing samples with equal names and labels):
- ``kvtier stats DIR``: the JSON snapshots the connector processes write to ``DIR/_stats``
  (or DIR itself if it holds them): ``<role>-<pid>.json``, refreshed every few seconds;
- ``kvtier stats --url http://127.0.0.1:PORT/metrics`` (repeatable): live Prometheus text,
  e.g. the scheduler process on ``metrics.port`` and the worker on ``metrics.port + 1``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()
err = Console(stderr=True, soft_wrap=True)  # one line per error, never wrapped

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


def merge(samples: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        for k, v in s.items():
            if k.endswith("_created"):
                continue
            out[k] = out.get(k, 0.0) + v
    return out


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


def from_url(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=5.0).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("kvtier_") or s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def total(samples: dict[str, float], name: str) -> tuple[float, dict[str, float]]:
    """Sum of a metric over its labels, and the per-label-set values."""
    per = {k[len(name):].strip("{}"): v for k, v in samples.items() if k == name or k.startswith(name + "{")}
    return sum(per.values()), per


def stats(
    directory: Path = typer.Argument(None, help="Disk tier directory (or its _stats folder) to read snapshots from."),
    url: list[str] = typer.Option(None, "--url", help="Prometheus endpoint(s) of running connector processes."),
    live_only: bool = typer.Option(False, help="Ignore snapshots of processes that have exited."),
    as_json: bool = typer.Option(False, "--json", help="Print merged samples as JSON."),
) -> None:
    """Print kvtier's connector and store metrics."""
    if directory is None and not url:
        raise typer.BadParameter("give a cache DIRECTORY or at least one --url")
    merged: list[dict[str, float]] = []
    docs: list[dict] = []
    if directory is not None:
        if not directory.is_dir():
            raise typer.BadParameter(f"{directory} is not a directory")
        s, docs = from_directory(directory, live_only)
        if not docs:
            err.print(f"[red]no kvtier stats snapshots under {directory}[/]")
            raise typer.Exit(1)
        merged.append(s)
    for u in url or []:
        try:
            merged.append(from_url(u))
        except Exception as e:
            err.print(f"[red]cannot read {u}: {e}[/]")
            raise typer.Exit(1)
    samples = merge(merged)
    if as_json:
        print(json.dumps(samples, indent=2, sort_keys=True))
        return
    if docs:
        src = Table(title="snapshots")
        for c in ("file", "role", "alive", "age"):
            src.add_column(c)
        for d in docs:
            src.add_row(d["file"], d.get("role", "?"), "yes" if d["alive"] else "exited",
                        f"{time.time() - d.get('time', 0):.0f}s")
        console.print(src)
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
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("stats")(stats)
