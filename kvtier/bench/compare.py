"""Run one workload against several server configurations and compare them.

Each configuration gets a fresh server (``kvtier.server``), started, replayed against and
stopped in turn; the first configuration is the baseline for speedups. A kvtier config with
the disk tier enabled and no ``store.disk.path`` gets a fresh empty directory under the
output folder (removed after the run unless ``keep_disk``); an explicit path is used as
given. A configuration whose server fails to start is reported as failed and the others
still run.

Configuration file (YAML): a list of entries, or ``{defaults: {...}, configs: [...]}``::

    defaults: {kv_cache_space_gib: 1, max_model_len: 4096, dtype: auto}
    configs:
      - name: vllm-baseline
      - name: kvtier-disk
        kvtier: {store: {disk: {enabled: true}}}

Output: ``<out>/<name>/{server.log,requests.jsonl,summary.json[,slo/]}``, ``compare.json``,
``report.md`` and plots.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, Protocol, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier import units
from kvtier.client.stream import RequestRecord
from kvtier.client.replay import (ReplayError, ReplayOptions, load_conversations, progress_bar, replay_conversations,
                                 write_json)
from kvtier.bench.report import RunView, render_report
from kvtier.client.slo import SloOptions, SloResult, run_slo
from kvtier.config import ConfigError, KvtierConfig, deep_merge, read_yaml_mapping
from kvtier.server import DEFAULT_READY_TIMEOUT_S, ServerError, ServerSpec, VllmServer, check_spec, server_dtype

SPEEDUP_KEYS = ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "e2e_mean")


class RunningServer(Protocol):
    base_url: str


StartServer = Callable[..., ContextManager[RunningServer]]


class CompareEntry(BaseModel):
    """One configuration in the compare YAML (ServerSpec fields + kvtier config)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    model: str | None = None
    port: int | None = None
    max_model_len: int | None = 4096
    max_num_batched_tokens: int | None = None
    kv_cache_space_gib: float | None = 1.0
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "bfloat16", "float32", "float16"] | None = None  # None: the command's --dtype
    kvtier: dict[str, Any] | None = None          # KvtierConfig fields
    kvtier_config_file: str | None = None         # or a kvtier YAML config file
    extra_args: list[str] = []


def default_model() -> str:
    from kvtier.model import default_model_path
    return str(default_model_path())


def load_compare_specs(path: str | Path, model: str | None = None, dtype: str = "auto") -> list[ServerSpec]:
    """Parse the compare YAML into ServerSpecs; raises ConfigError with one clear line.

    ``model``/``dtype`` apply to entries that do not name their own ("auto": kvtier.compute.choose_dtype).
    """
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"compare config not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {str(e).splitlines()[0]}") from None
    defaults: dict[str, Any] = {}
    if isinstance(data, dict):
        defaults = data.get("defaults") or {}
        unknown = set(data) - {"defaults", "configs"}
        if unknown:
            raise ConfigError(f"{p}: unknown top-level keys {sorted(unknown)} (expected defaults, configs)")
        data = data.get("configs")
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{p}: expected a non-empty list of configurations")
    specs = []
    for i, raw in enumerate(data):
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: configuration #{i + 1} is not a mapping")
        try:
            entry = CompareEntry.model_validate({**defaults, **raw})
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(f"{p}: configuration #{i + 1} ({raw.get('name', '?')}): "
                              f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        kv: dict[str, Any] | None = None
        if entry.kvtier is not None or entry.kvtier_config_file is not None:
            base = read_yaml_mapping(p.parent / entry.kvtier_config_file) if entry.kvtier_config_file else {}
            kv = _kvtier_dict(base, entry.kvtier or {}, entry.name)
        specs.append(ServerSpec(name=entry.name, model=entry.model or model or default_model(), port=entry.port,
                                max_model_len=entry.max_model_len, max_num_batched_tokens=entry.max_num_batched_tokens,
                                kv_cache_space_gib=entry.kv_cache_space_gib,
                                enable_prefix_caching=entry.enable_prefix_caching, dtype=entry.dtype or dtype,
                                kvtier_config=kv, extra_args=tuple(entry.extra_args)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{p}: configuration names must be unique, got {names}")
    return specs


def _kvtier_dict(base: dict[str, Any], over: dict[str, Any], name: str) -> dict[str, Any]:
    """Merge, then validate everything but a missing disk path (filled in per run)."""
    merged = deep_merge(base, over)
    probe = deep_merge(merged, {"store": {"disk": {"path": "/placeholder"}}}) if _disk_needs_path(merged) else merged
    try:
        KvtierConfig.model_validate(probe)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"configuration {name!r}: kvtier.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return merged


def _disk_needs_path(kv: dict[str, Any]) -> bool:
    disk = (kv.get("store") or {}).get("disk") or {}
    return bool(disk.get("enabled")) and not disk.get("path")


@dataclass
class ConfigRun:
    spec: ServerSpec
    out_dir: Path
    summary: dict[str, Any] | None = None
    records: list[RequestRecord] = field(default_factory=list)
    slo: SloResult | None = None
    error: str | None = None
    disk_dir: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class CompareResult:
    workload: str
    out_dir: Path
    runs: list[ConfigRun]
    speedups: dict[str, dict[str, float | None]]
    summary_path: Path
    report_path: Path | None = None


def speedups_vs_baseline(runs: Sequence[ConfigRun]) -> dict[str, dict[str, float | None]]:
    """baseline latency / config latency for each SPEEDUP_KEYS (>1: faster than baseline)."""
    base = runs[0].summary if runs and runs[0].summary else None
    out: dict[str, dict[str, float | None]] = {}
    for r in runs:
        row: dict[str, float | None] = {}
        for k in SPEEDUP_KEYS:
            b, c = (base or {}).get(f"{k}_s"), (r.summary or {}).get(f"{k}_s")
            row[k] = b / c if b and c else None
        if base and r.slo and runs[0].slo and r.slo.best_load and runs[0].slo.best_load:
            row["slo_load"] = r.slo.best_load / runs[0].slo.best_load
        out[r.name] = row
    return out


def describe(spec: ServerSpec) -> str:
    kv = "vLLM only" if spec.kvtier_config is None else f"kvtier `{json.dumps(spec.kvtier_config)}`"
    return (f"{kv}; KV cache {spec.kv_cache_space_gib} GiB; prefix caching "
            f"{'on' if spec.enable_prefix_caching else 'off'}; max_model_len {spec.max_model_len}; "
            f"dtype {server_dtype(spec).dtype}")


def _with_fresh_disk(spec: ServerSpec, run_dir: Path) -> tuple[ServerSpec, str | None]:
    if spec.kvtier_config is None or not _disk_needs_path(spec.kvtier_config):
        return spec, None
    disk = tempfile.mkdtemp(prefix="disk-", dir=run_dir)
    return replace(spec, kvtier_config=deep_merge(spec.kvtier_config, {"store": {"disk": {"path": disk}}})), disk


def _with_metrics_port(spec: ServerSpec) -> ServerSpec:
    """A kvtier spec without ``metrics.port`` gets a free pair (scheduler, worker rank 0): kvtier's
    counters live in the engine processes, never in the API server's ``/metrics``."""
    if spec.kvtier_config is None or (spec.kvtier_config.get("metrics") or {}).get("port"):
        return spec
    from kvtier.ports import free_port

    try:
        port = free_port(2)
    except OSError:
        return spec
    return replace(spec, kvtier_config=deep_merge(spec.kvtier_config, {"metrics": {"port": port}}))


def _extra_metrics(spec: ServerSpec) -> tuple[str, ...]:
    """kvtier's own Prometheus endpoints: the scheduler on ``metrics.port``, worker rank 0 on port+1."""
    port = ((spec.kvtier_config or {}).get("metrics") or {}).get("port")
    return (f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{int(port) + 1}/metrics") if port else ()


def run_compare(workload_path: str | Path, specs: Sequence[ServerSpec], out_dir: str | Path,
                replay_options: ReplayOptions, *, slo: SloOptions | None = None, keep_disk: bool = False,
                ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S, start_server: StartServer = VllmServer.start,
                title: str | None = None, on_event: Callable[[str], None] = lambda m: None) -> CompareResult:
    """Replay ``workload_path`` against each spec on a fresh server; write results and the report.

    ``start_server(spec, log_path, ready_timeout_s=...)`` returns a context manager with
    ``base_url`` (default ``VllmServer.start``; tests inject a fake). With ``slo``, an SLO
    search runs after the replay on the same server.
    """
    if not specs:
        raise ReplayError("compare needs at least one configuration")
    for spec in specs:       # every configuration is checked before the first server starts
        probe = spec
        if spec.kvtier_config is not None and _disk_needs_path(spec.kvtier_config):
            probe = replace(spec, kvtier_config=deep_merge(spec.kvtier_config, {"store": {"disk": {"path": "/p"}}}))
        try:
            check_spec(probe, check_model=start_server == VllmServer.start)   # fakes serve any model
        except ServerError as e:
            raise ConfigError(str(e)) from None
    convs, _bad = load_conversations(workload_path, replay_options.skip_bad_lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[ConfigRun] = []
    for spec in specs:
        run_dir = out / spec.name
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_run, disk = _with_fresh_disk(_with_metrics_port(spec), run_dir)
        run = ConfigRun(spec=spec_run, out_dir=run_dir, disk_dir=disk)
        runs.append(run)
        on_event(f"[{spec.name}] starting server")
        try:
            with start_server(spec_run, run_dir / "server.log", ready_timeout_s=ready_timeout_s) as server:
                opts = replace(replay_options, extra_metrics_urls=replay_options.extra_metrics_urls
                               + _extra_metrics(spec_run))
                on_event(f"[{spec.name}] replaying {workload_path} against {server.base_url}")
                _replay_into(run, convs, server.base_url, opts)
                if slo is not None:
                    on_event(f"[{spec.name}] SLO search")
                    run.slo = run_slo(convs, server.base_url, opts, slo, run_dir / "slo")
        except (ServerError, ReplayError) as e:
            run.error = str(e)
            on_event(f"[{spec.name}] failed: {str(e).splitlines()[0]}")
        finally:
            if disk and not keep_disk:
                shutil.rmtree(disk, ignore_errors=True)
        if run.summary:
            on_event(f"[{spec.name}] TTFT mean {units.seconds(run.summary['ttft_mean_s'])}, "
                     f"hit rate {units.percent(run.summary['token_hit_rate'])}")
    speedups = speedups_vs_baseline(runs)
    result = CompareResult(workload=str(workload_path), out_dir=out, runs=runs, speedups=speedups,
                           summary_path=out / "compare.json")
    write_json(result.summary_path, compare_json(result))
    result.report_path = render_report(
        [RunView(r.name, r.summary, r.records, r.slo, r.error, describe(r.spec)) for r in runs], out,
        title=title or f"kvtier comparison: {Path(workload_path).name}", speedups=speedups,
        notes=[f"workload: `{workload_path}` ({len(convs)} conversations)",
               f"replay: mode {replay_options.mode}, concurrency {replay_options.concurrency}, "
               f"rate {replay_options.rate}, max_requests {replay_options.max_requests}, "
               f"duration {replay_options.duration_s}, history {replay_options.history}",
               "every configuration ran on a fresh server and received identical prompts"
               if replay_options.history == "workload" else
               "every configuration ran on a fresh server; live history: each turn carried the replies that "
               "configuration's server streamed for the conversation's earlier turns (same user messages)"])
    return result


def _replay_into(run: ConfigRun, convs: list, url: str, opts: ReplayOptions) -> None:
    records_path = run.out_dir / "requests.jsonl"
    total = sum(len(c.turns) for c in convs)
    with records_path.open("w") as fh, progress_bar(min(total, opts.max_requests or total), opts.progress) as bar:
        def on_record(rec: RequestRecord) -> None:
            fh.write(rec.to_json() + "\n")
            fh.flush()
        result = asyncio.run(replay_conversations(convs, url, opts, on_record, bar))
    run.summary, run.records = result.summary, result.records
    write_json(run.out_dir / "summary.json", result.summary)


def compare_json(result: CompareResult) -> dict[str, Any]:
    return {
        "workload": result.workload,
        "baseline": result.runs[0].name if result.runs else None,
        "speedups": result.speedups,
        "configs": [{"name": r.name, "spec": asdict(r.spec), "error": r.error, "summary": r.summary,
                     "slo": r.slo.to_dict() if r.slo else None,
                     "records": str(r.out_dir / "requests.jsonl")} for r in result.runs],
    }
