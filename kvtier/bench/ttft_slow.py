"""``kvtier bench ttft --slow-tier``: is a hit ever slower than recomputing? A prompt whose chunks
are only in a shared tier, read by a fresh engine with empty local tiers, the tier slowed by
``store.faults`` latency so that loading the hit takes about twice as long as computing it; kvtier
with ``claims.policy: always`` (every chunk any tier holds) and ``pays-off`` (only what loads faster
than it computes), and the same tier at full speed under both policies. Every row comes from the
same run, its ratio against recompute (vanilla vLLM, cold) from the same run.

Order (``ttft_slow_engine``): recompute (vanilla vLLM, cold), the writer (kvtier, SSD; cold =
kvtier miss), the shared directory filled from the writer's SSD chunk files (``shared_seed``), one
fresh engine per (speed, policy), recompute again (the baseline is the median of both recompute
engines' prompts, so it spans the readers' time on a machine shared with other work). The latency,
unless given, is sized from the writer's cold time: per read
``L = 2 x compute(hit) / (1 + ceil(chunks / reads in flight))`` (one existence query, then the reads,
``connector.async_read_depth`` at a time), so the whole load takes about 2x the compute it replaces.

Checks (``violations``, the run fails): a timed prompt's prefix-cache reset failed, a cold row hit
a cache, an ``always`` row or a full-speed row did not load the hit from the shared directory (the
figure would not be what it says). What ``pays-off`` did is recorded per sample (tokens loaded,
chunks declined), not required: the policy decides.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.bench.ttft_check import HitEvidence, expected_hit_tokens, verify_kvtier_hit
from kvtier.bench.ttft_slow_engine import READERS
from kvtier.compute import choose_dtype

READS_IN_FLIGHT = 2          # connector.async_read_depth's default: the shared tier's reads in flight


@dataclass
class SlowConfigResult:
    """One reader configuration at one length: median TTFT and what its requests did."""

    ttft_s: float | None = None
    vs_recompute: float | None = None
    cold_here_s: float | None = None                      # the same engine's own cold prompts (median)
    vs_cold_here: float | None = None
    cold_here_samples_s: list = field(default_factory=list)
    vs_kvtier_miss: float | None = None
    loaded_tokens: list = field(default_factory=list)      # per timed prompt
    declined_chunks: list = field(default_factory=list)    # per timed prompt (kvtier_claims_declined_total)
    samples_s: list = field(default_factory=list)
    probe_s: float | None = None
    teach_s: float | None = None
    other_cores_avg: float | None = None                  # other processes' CPU during this engine


@dataclass
class SlowTierRow:
    prompt_tokens: int
    hit_tokens: int
    recompute_s: float | None = None        # vanilla cold (median over both recompute engines)
    recompute_samples_s: list = field(default_factory=list)
    kvtier_miss_s: float | None = None      # the writer's cold (median)
    configs: dict = field(default_factory=dict)   # role -> SlowConfigResult


@dataclass
class SlowTierReport:
    command: str
    machine: dict
    model: str
    dtype: str
    repeats: int
    latency_ms: float
    latency_sized: str
    max_num_batched_tokens: int
    rows: list = field(default_factory=list)
    shared_seed: dict = field(default_factory=dict)
    violations: list = field(default_factory=list)
    crashes: dict = field(default_factory=dict)
    kvtier_configs: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)


def slow_latency_ms(cold_s: float, prompt_tokens: int, hit_tokens: int, chunk: int,
                    in_flight: int = READS_IN_FLIGHT, factor: float = 2.0) -> float:
    """Per-read latency that makes loading ``hit_tokens`` take ``factor`` x computing them (one
    existence query, then ``ceil(chunks / in_flight)`` rounds of reads)."""
    rounds = 1 + -(-(-(-hit_tokens // chunk)) // in_flight)
    return 1000.0 * factor * cold_s * hit_tokens / prompt_tokens / rounds


def _median(xs) -> float | None:
    vals = [x["s"] if isinstance(x, dict) else x for x in xs or []]
    return statistics.median(vals) if vals else None


def _declined(sample: dict) -> int:
    return int(sum(v for k, v in sample.get("kvtier", {}).items() if k.startswith("kvtier_claims_declined_total")))


def _loaded(sample: dict) -> int:
    return int(sample.get("kvtier", {}).get("kvtier_connector_loaded_tokens_total", 0))


def _run(module: str, role: str, args: list[str], root: Path, timeout_s: float, log) -> tuple[dict | None, str | None]:
    from kvtier.bench.ttft import CpuMeter, error_line

    out = root / f"{role.replace(':', '-')}.json"
    logf = out.with_suffix(".log")
    log(f"[ttft --slow-tier] {role}: starting engine")
    t0, meter = time.time(), CpuMeter()
    with open(logf, "w") as lf:
        try:
            rc = subprocess.run([sys.executable, "-m", module, role, *args, "--dir", str(root), "--out", str(out)],
                                stdout=lf, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    log(f"[ttft --slow-tier] {role}: rc={rc} in {time.time() - t0:.0f}s")
    res = json.loads(out.read_text()) if out.exists() else None
    if res is not None:
        res["load"] = meter.summary()
    return res, (None if rc == 0 else f"exit {rc}: {error_line(logf.read_text(errors='replace'))}")


def run_slow_tier(model: str, workdir: Path, lengths: list[int], repeats: int = 3, dtype: str = "auto",
                  latency_ms: float | None = None, timeout_s: float = 1800, command: str = "", log=print,
                  max_batched: int = 2048) -> SlowTierReport:
    """Every engine of the comparison, one after another (see the module doc)."""
    import shutil

    from kvtier.bench.shared_seed import seed_shared
    from kvtier.bench.ttft import CpuMeter
    from kvtier.bench.ttft_report import machine_description

    dtype = choose_dtype(dtype, source="config").dtype
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    meter = CpuMeter()
    report = SlowTierReport(command, machine_description(), model, dtype, repeats, 0.0, "", max_batched)
    mml = str(max(8448, max(lengths) + 256))
    common = ["--model", model, "--dtype", dtype, "--lengths", ",".join(map(str, lengths)),
              "--max-batched", str(max_batched), "--max-model-len", mml]
    runs: dict[str, dict | None] = {}
    for role in ("recompute:1", "writer"):
        runs[role], err = _run("kvtier.bench.ttft_slow_engine", role, common + ["--repeats", str(repeats)],
                               workdir, timeout_s, log)
        if err:
            report.crashes[role] = err
    writer = (runs.get("writer") or {}).get("rows", {})
    chunk, block = (runs.get("writer") or {}).get("chunk_size"), (runs.get("writer") or {}).get("block_size")
    if not writer or not chunk:
        report.violations.append("the writer engine produced no rows: nothing to read")
        return report
    n0 = lengths[0]
    hit0 = expected_hit_tokens(n0, chunk, block)
    if latency_ms is None:
        latency_ms = round(slow_latency_ms(_median(writer[str(n0)]["cold"]), n0, hit0, chunk))
        report.latency_sized = (f"2 x the writer's cold compute of the {hit0}-token hit at {n0} tokens over "
                                f"1 + ceil(chunks / {READS_IN_FLIGHT}) rounds")
    else:
        report.latency_sized = "given (--slow-latency-ms)"
    report.latency_ms = latency_ms
    sd = workdir / "shared"
    sd.mkdir()
    r = seed_shared(workdir / "kvtier", {"kind": "sharedfs", "path": str(sd), "janitor": False}, log=log)
    report.shared_seed = {"chunks": r.chunks, "bytes": r.nbytes, "readable": r.readable, "ok": r.ok,
                          "method": "the writer's SSD chunk files put into a shared-filesystem directory "
                                    "(local disk) through the tier's own put"}
    if not r.ok:
        report.violations.append("seed: not every chunk reached the shared directory")
    for role in READERS + ("recompute:2",):
        runs[role], err = _run("kvtier.bench.ttft_slow_engine", role,
                               common + ["--repeats", str(repeats), "--latency-ms", str(latency_ms)],
                               workdir, timeout_s, log)
        if err:
            report.crashes[role] = err
        if runs[role] and runs[role].get("kvtier_config"):
            report.kvtier_configs[role] = runs[role].get("kvtier_config")
    for n in lengths:
        report.rows.append(_row(n, runs, chunk, block, report.violations))
    report.load = meter.summary()
    return report


def _row(n: int, runs: dict, chunk: int, block: int, violations: list) -> SlowTierRow:
    k = str(n)
    hit = expected_hit_tokens(n, chunk, block)
    row = SlowTierRow(n, hit)
    cold = [s for r in ("recompute:1", "recompute:2")
            for s in (((runs.get(r) or {}).get("rows") or {}).get(k, {}).get("cold") or [])]
    wr = ((runs.get("writer") or {}).get("rows") or {}).get(k, {})
    row.recompute_s, row.kvtier_miss_s = _median(cold), _median(wr.get("cold"))
    row.recompute_samples_s = [round(s["s"], 4) for s in cold]
    for s in cold + (wr.get("cold") or []):
        if s.get("cached"):
            violations.append(f"cold {n}: {s['cached']} tokens came from a cache")
    for role in READERS:
        got = ((runs.get(role) or {}).get("rows") or {}).get(k)
        if not got:
            continue
        samples = got.get("hit", [])
        c = SlowConfigResult(_median(samples), samples_s=[round(s["s"], 4) for s in samples],
                             loaded_tokens=[_loaded(s) for s in samples],
                             declined_chunks=[_declined(s) for s in samples],
                             probe_s=got.get("probe", {}).get("s"), teach_s=got.get("teach", {}).get("s"),
                             cold_here_s=_median(got.get("cold")),
                             cold_here_samples_s=[round(s["s"], 4) for s in got.get("cold", [])],
                             other_cores_avg=((runs.get(role) or {}).get("load") or {}).get("other_processes_cores_avg"))
        if c.ttft_s and c.cold_here_s:
            c.vs_cold_here = c.ttft_s / c.cold_here_s
        if c.ttft_s and row.recompute_s:
            c.vs_recompute = c.ttft_s / row.recompute_s
        if c.ttft_s and row.kvtier_miss_s:
            c.vs_kvtier_miss = c.ttft_s / row.kvtier_miss_s
        for s in got.get("cold", []):
            if s.get("cached"):
                violations.append(f"{role} cold {n}: {s['cached']} tokens came from a cache")
        for s in samples:
            if s.get("reset_ok") is not True:
                violations.append(f"{role} {n}: prefix-cache reset failed")
            if role.endswith(":always") or role.startswith("fast:"):   # must be a real shared-tier hit
                ev = HitEvidence(hit, chunk, s["reset_ok"], s["cached"], s["kvtier"])
                violations += [f"{role} {n}: {v}" for v in verify_kvtier_hit(ev, "sharedfs")]
        row.configs[role] = c
    return row


def report_json(report: SlowTierReport) -> dict:
    return asdict(report)


def report_markdown(report: SlowTierReport) -> str:
    def f(x, d=3):
        return "—" if x is None else f"{x:.{d}f}"

    labels = {"slow:always": "slow tier, claims always", "slow:pays-off": "slow tier, claims pays-off",
              "fast:always": "full-speed tier, claims always", "fast:pays-off": "full-speed tier, claims pays-off"}
    lines = [f"# TTFT with a slow shared tier ({report.model.split('/')[-1]}, {report.dtype})", "",
             f"Command: `{report.command}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in report.machine.items()), "",
             f"Shared tier: a shared-filesystem directory on local disk, read by a fresh engine with empty RAM "
             f"and no SSD (page cache dropped before each prompt); slow = `store.faults` latency "
             f"{report.latency_ms:.0f} ms on every read and existence query ({report.latency_sized}). "
             f"Median of {report.repeats} distinct prompts; every engine first computed one prompt of its own, "
             f"each reader then loaded one other from the tier (its estimates' first samples), not in the table; "
             f"readers save nothing (the shared directory stays as seeded). "
             f"max_num_batched_tokens={report.max_num_batched_tokens}. Times in seconds; ratios against "
             "recompute (vanilla vLLM, cold), the reader's own cold prompts (one before each hit, same engine; "
             "with the slow tier under `always` they also wait for its existence query) and kvtier miss (kvtier "
             "on, empty cache) of the same run; last column: other processes' CPU during that engine.", "",
             "Other processes during the run: " + ", ".join(f"{k}={v}" for k, v in report.load.items()), ""]
    for r in report.rows:
        lines += [f"## {r.prompt_tokens} tokens ({r.hit_tokens} in the hit)", "",
                  f"Recompute (vanilla cold, both recompute engines) {f(r.recompute_s)} s "
                  f"(samples {r.recompute_samples_s}), kvtier miss {f(r.kvtier_miss_s)} s.", "",
                  "| configuration | TTFT | / recompute | own cold prompts | / own cold | / kvtier miss | tokens loaded "
                  "| chunks declined | samples | other processes (cores) |",
                  "|---|---:|---:|---:|---:|---:|---|---|---|---:|"]
        for role, c in r.configs.items():
            c = c if isinstance(c, SlowConfigResult) else SlowConfigResult(**c)
            lines.append(f"| {labels.get(role, role)} | {f(c.ttft_s)} | {f(c.vs_recompute, 2)} | "
                         f"{f(c.cold_here_s)} | {f(c.vs_cold_here, 2)} | {f(c.vs_kvtier_miss, 2)} | "
                         f"{c.loaded_tokens} | {c.declined_chunks} | {c.samples_s} | {f(c.other_cores_avg, 2)} |")
        lines.append("")
    if report.crashes:
        lines += ["Engines that failed:", ""] + [f"- `{k}`: {v}" for k, v in report.crashes.items()] + [""]
    if report.violations:
        lines += ["ROWS THAT DID NOT MEASURE WHAT THEY SAY (figures invalid):", ""]
        lines += [f"- {v}" for v in report.violations] + [""]
    return "\n".join(lines)
