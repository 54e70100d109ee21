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
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.bench.ttft_engine import PEERS, ROLES, kvtier_bench_config
from kvtier.bench.ttft_report import machine_description
from kvtier.bench.ttft_result import MAX_BATCHED, TtftReport, TtftRow
from kvtier.compute import choose_dtype, kv_bytes_per_token

if TYPE_CHECKING:
    from kvtier.bench.rawread import RawRead


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

def _role_file(root: Path, role: str) -> Path:
    return root / f"{role.replace(':', '-')}.json"


def _run_engine(role: str, model: str, dtype: str, lengths: list[int], repeats: dict[int, int], root: Path,
                timeout_s: float, log, max_batched: int = MAX_BATCHED,
                extra: tuple[str, ...] = ()) -> tuple[dict | None, str | None]:
    out = _role_file(root, role)
    logf = out.with_suffix(".log")
    cmd = [sys.executable, "-m", "kvtier.bench.ttft_engine", role, "--model", model, "--dtype", dtype,
           "--lengths", ",".join(map(str, lengths)), "--repeats", ",".join(str(repeats[n]) for n in lengths),
           "--dir", str(root), "--out", str(out),
           "--max-batched", str(max_batched), "--max-model-len", str(max(8448, max(lengths) + 256)), *extra]
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


def _ideal_read(workdir: Path, hit_tokens: int, chunk: int, per_tok: int) -> RawRead | None:
    from kvtier.bench.rawread import best_raw_read, tier_reads_in_flight
    from kvtier.chunk import file_size
    from kvtier.integrations.vllm.worker_side import PREFETCH_DEPTH    # the connector's chunk reads in flight

    chunks = -(-hit_tokens // chunk)          # chunk files the hit reads (the last one may be used in part)
    if chunks <= 0:
        return None
    fbytes = file_size(chunk * per_tok)
    inflight, piece = tier_reads_in_flight(fbytes, PREFETCH_DEPTH)
    return best_raw_read(workdir / "rawread", fbytes, chunks, inflight, piece)


def _earlier(workdir: Path, role: str) -> dict | None:
    f = _role_file(workdir, role)
    try:
        return json.loads(f.read_text()) if f.exists() else None
    except ValueError:
        return None


def merge_rows(earlier: dict, now: dict | None) -> dict:
    """A role re-run (``--resume``) on other lengths: its new rows, plus the earlier run's rows for
    lengths it did not measure now (and both runs' violations and diagnosis)."""
    if now is None:
        return earlier
    out = dict(now)
    out["rows"] = {**{k: v for k, v in earlier.get("rows", {}).items() if k not in now.get("rows", {})},
                   **now.get("rows", {})}
    def length_of(v: str) -> str:          # violations read "<label> <length>: <what>"
        parts = v.split(" ")
        return parts[1].rstrip(":") if len(parts) > 1 else ""
    out["violations"] = [v for v in earlier.get("violations", [])
                         if length_of(v) not in now.get("rows", {})] + now.get("violations", [])
    if "diag" not in out and "diag" in earlier:
        out["diag"] = earlier["diag"]
    out.setdefault("block_size", earlier.get("block_size"))
    out.setdefault("chunk_size", earlier.get("chunk_size"))
    return out


def _seed(target, workdir: Path, log) -> dict:
    from kvtier.bench.shared_seed import seed_shared

    disk = workdir / "kvtier"
    if not disk.is_dir():
        return {"error": "no kvtier-w SSD directory to seed from (run kvtier-w first)"}
    r = seed_shared(disk, target.write, log=log)
    log(f"[ttft] seeded {target.kind}: {r.chunks} chunks, {r.nbytes / 1e6:.0f} MB in {r.seconds:.1f} s, "
        f"{r.readable} read back, {r.refused} refused, {len(r.skipped)} skipped")
    return {"chunks": r.chunks, "bytes": r.nbytes, "seconds": round(r.seconds, 2), "readable": r.readable,
            "refused": r.refused, "skipped": r.skipped[:5], "ok": r.ok,
            "method": "kvtier-w's SSD chunk files put into the backend through its tier's put (writer mount/config)"}


def run_ttft(model: str, workdir: Path, lengths: list[int], repeats: int | dict[int, int] = 3, dtype: str = "auto",
             with_example: bool = True, timeout_s: float = 1800, command: str = "", log=print,
             roles: tuple[str, ...] | None = None, max_batched: int = MAX_BATCHED,
             with_peers: bool = True, shared: tuple = (), resume: bool = False,
             diag: bool = False) -> TtftReport:
    """Run the engines of ``roles`` (default: all but the shared readers; each ``shared`` target
    (``shared_seed.SharedTarget``) adds its ``shared-r:KIND`` reader). ``resume``: keep ``workdir``
    and take the results of roles not run now from an earlier invocation's files there (a
    heavy run split into several jobs)."""
    import shutil

    dtype = choose_dtype(dtype, source="config").dtype   # "auto": what this CPU computes fast
    reps = repeats if isinstance(repeats, dict) else {n: repeats for n in lengths}
    if workdir.exists() and not resume:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    meter = CpuMeter()
    runs: dict[str, dict | None] = {}
    crashes: dict[str, str] = {}
    targets = {t.kind: t for t in shared}
    if roles is None:
        roles = (("vanilla", "kvtier-w", "kvtier-r") + (("example-w", "example-r") if with_example else ())
                 + tuple(f"shared-r:{k}" for k in targets)
                 + (tuple(f"peer:{p}" for p in PEERS) if with_peers else ()))
    resumed = []
    if resume:
        for role in ALL_ROLES:
            f = _role_file(workdir, role)
            if role not in roles and f.exists():
                runs[role] = json.loads(f.read_text())
                resumed.append(role)
    seeds: dict[str, dict] = {}
    for role in roles:
        limit = min(timeout_s, 900) if role.startswith("peer:") else timeout_s   # a peer may hang at start-up
        extra: tuple[str, ...] = ("--diag",) if diag else ()
        if role.startswith("shared-r:"):
            kind = role.split(":", 1)[1]
            if kind not in targets:
                crashes[role] = f"no shared target for {kind} (give its backend)"
                continue
            seeds[kind] = _seed(targets[kind], workdir, log)
            cfg_file = workdir / f"shared-{kind}.json"       # a file, not argv: configs may name hosts/paths
            cfg_file.write_text(json.dumps(targets[kind].read))
            os.chmod(cfg_file, 0o600)
            extra += ("--shared", str(cfg_file), "--evict", os.pathsep.join(targets[kind].evict))
        earlier = _earlier(workdir, role) if resume else None
        res, err = _run_engine(role, model, dtype, lengths, reps, workdir, limit, log, max_batched, extra)
        if earlier is not None:
            res = merge_rows(earlier, res)
            _role_file(workdir, role).write_text(json.dumps(res))
        runs[role] = res
        if err:
            crashes[role] = err
    all_roles = tuple(roles) + tuple(resumed)
    with_example = "example-r" in all_roles
    geometry = next((r for r in runs.values() if r and r.get("block_size")), {})
    block, chunk = geometry.get("block_size"), geometry.get("chunk_size")
    per_tok = kv_bytes_per_token(Path(model), dtype)
    violations = [f"{role}: {v}" for role, r in runs.items() if r for v in r.get("violations", [])]
    violations += [f"{role} diag: {v}" for role, r in runs.items() if r for v in (r.get("diag") or {}).get(
        "violations", [])]
    violations += [f"seed {k}: {v.get('error') or 'not every chunk reached the backend'}"
                   for k, v in seeds.items() if not v.get("ok")]
    report = TtftReport(command=command, machine=machine_description(), model=model, dtype=dtype,
                        repeats={str(n): reps[n] for n in lengths}, raw_read=None, crashes=crashes,
                        max_num_batched_tokens=max_batched,
                        block_size=block, chunk_size=chunk, violations=violations,
                        kvtier_config=kvtier_bench_config("<workdir>/kvtier"), shared_seed=seeds,
                        shared_targets={k: {"kind": t.kind, "evict": list(t.evict)} for k, t in targets.items()},
                        diag={role: r["diag"] for role, r in runs.items() if r and r.get("diag")},
                        resumed_roles=resumed)

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
        r.repeats = reps[n]
        r.example_connector_s = _median(ex) if ex and len(ex) == reps[n] else None
        if r.example_connector_s is None and with_example:
            r.example_connector_error = crashes.get("example-r") or crashes.get("example-w") or "no result"
        for role in all_roles:
            if role.startswith("peer:") and rows(role).get(k, {}).get("hit"):
                r.peers_hit_s[role[5:]] = _median(rows(role)[k]["hit"])
            if role.startswith("shared-r:") and rows(role).get(k, {}).get("shared_hit"):
                r.shared_hit_s[role[9:]] = _median(rows(role)[k]["shared_hit"])
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
