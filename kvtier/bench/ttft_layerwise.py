"""``kvtier bench ttft --layerwise``: an SSD hit with a new suffix, loaded whole before the forward
pass (``connector.load_mode: whole``) and layer by layer while it runs (``layerwise``), in one engine.

One engine process (``python -m kvtier.bench.ttft_layerwise ...``, in-process vLLM as in
``ttft_engine``), kvtier with an SSD tier and no RAM tier, so every hit reads chunk files. Per
prompt length P (the stored prefix) and suffix S, for each of ``repeats`` distinct prefixes:

  cold      prefix + suffix X, computed (saves the prefix's chunks), then the store's flush
  whole     prefix cache reset, chunk files evicted from the page cache, prefix + new suffix, loaded
            by the whole-request path; ``load alone`` = that load's wall time (``WorkerSide.last_load``:
            nothing else runs during it)
  compute   prefix + another new suffix right after, no reset: vLLM's prefix cache holds the prefix,
            so this is the suffix computed alone at the same context length (``suffix compute alone``)
  layer     as ``whole`` with yet another suffix, loaded layer by layer; then its own ``compute``
The two modes alternate which goes first from one prefix to the next. The load mode is switched on
the worker between requests (the same engine, the same files, the same machine state). Every hit
is checked (``ttft_check``): reset succeeded, vLLM counted P cached tokens, kvtier loaded P tokens,
all from the disk tier. Reported (medians): TTFT of each mode, load alone, suffix compute alone,
and each mode's TTFT / max(load alone, suffix compute alone) (the target for layerwise is 1.15).
Also the save time of the cold requests (whether per-layer saves could shorten a step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.ttft_check import HitEvidence, verify_kvtier_hit

MODES = ("whole", "layerwise")


@dataclass
class LayerwiseRow:
    prefix_tokens: int
    suffix_tokens: int
    whole_s: float | None = None
    layerwise_s: float | None = None
    load_alone_s: float | None = None
    compute_alone_s: float | None = None
    cold_s: float | None = None
    whole_vs_bound: float | None = None          # whole / max(load alone, compute alone)
    layerwise_vs_bound: float | None = None
    layerwise_vs_whole: float | None = None
    layerwise_wait_s: float | None = None        # what the forward pass waited for layers (median)
    cold_save_s: float | None = None             # the cold request's save copies + puts (median)
    samples: dict = field(default_factory=dict)


@dataclass
class LayerwiseReport:
    command: str
    machine: dict
    model: str
    dtype: str
    repeats: int
    max_num_batched_tokens: int
    kvtier_config: dict
    rows: list = field(default_factory=list)
    violations: list = field(default_factory=list)


# -- engine process ---------------------------------------------------------------------------
def engine_config(disk: Path) -> dict:
    from kvtier.bench.ttft_engine import CHUNK

    return {"store": {"chunk_size": CHUNK, "memory": {"enabled": False},
                      "disk": {"enabled": True, "path": str(disk), "capacity": "16GiB"}},
            "connector": {"load_timeout_s": 120.0}}


def _worker():
    """This process's kvtier worker half (the engine runs in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def _sample(eng, worker, prompt: list[int], reset: bool, mode: str | None, disk: Path) -> dict:
    from kvtier.bench.ttft_engine import evict_page_cache

    if mode is not None:
        worker.layerwise = mode == "layerwise"
        evict_page_cache(disk)
    worker.last_load = None
    s = eng.timed(prompt, reset=reset)
    ll = worker.last_load
    if ll is not None:
        s["load"] = {"total": ll.total, "read": ll.read, "wait": ll.wait, "copy": ll.copy}
    return s


def engine_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--suffix", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-batched", type=int, default=2048)
    a = ap.parse_args(argv)
    from kvtier.bench.ttft_engine import Engine, _flush_kvtier, bench_prompts, prepare_engine_process

    prepare_engine_process()
    from kvtier.engine import make_llm
    from kvtier.server import kv_transfer_config

    disk = Path(a.dir) / "kvtier"
    lengths = [int(x) for x in a.lengths.split(",")]
    llm = make_llm(a.model, dtype=a.dtype, max_model_len=max(lengths) + a.suffix + 64,
                   kv_transfer_config=kv_transfer_config(engine_config(disk)), max_num_batched_tokens=a.max_batched,
                   enable_prefix_caching=True)
    eng, tok, worker = Engine(llm, True), llm.get_tokenizer(), _worker()
    eng.timed(bench_prompts(tok, 64, 1, "warmup")[0], reset=False)
    result: dict[str, Any] = {"pid": os.getpid(), "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                              "rows": {}}
    for n in lengths:
        prefixes = bench_prompts(tok, n, a.repeats, "layerwise")
        tails = [bench_prompts(tok, a.suffix, 5, f"layerwise-suffix-{n}-{i}") for i in range(a.repeats)]
        eng.timed(bench_prompts(tok, n + a.suffix, 1, "layerwise-teach")[0], reset=True)   # one-time costs
        rows: dict[str, list] = {"cold": [], "whole": [], "layerwise": [], "compute": []}
        for i, (pre, t) in enumerate(zip(prefixes, tails)):
            rows["cold"].append(_sample(eng, worker, pre + t[0], True, None, disk))
            _flush_kvtier()
            order = MODES if i % 2 == 0 else MODES[::-1]
            for k, mode in enumerate(order):
                rows[mode].append(_sample(eng, worker, pre + t[1 + 2 * k], True, mode, disk))
                rows["compute"].append(_sample(eng, worker, pre + t[2 + 2 * k], False, None, disk))
        result["rows"][str(n)] = rows
    worker.layerwise = False
    Path(a.out).write_text(json.dumps(result))
    return 0


# -- orchestrator -----------------------------------------------------------------------------
def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _save_s(sample: dict) -> float:
    return sum(v for k, v in sample.get("kvtier", {}).items() if k.startswith("kvtier_connector_save_seconds_sum"))


def summarize(n: int, suffix: int, raw: dict, chunk: int) -> tuple[LayerwiseRow, list[str]]:
    """One length's figures from its engine samples, and the samples that do not prove their label."""
    bad = []
    for mode in MODES:
        for s in raw[mode]:
            ev = HitEvidence(n // chunk * chunk, chunk, s["reset_ok"], s["cached"], s.get("kvtier", {}))
            bad += [f"{mode} {n}: {v}" for v in verify_kvtier_hit(ev, "disk")]
    for s in raw["compute"]:
        if s["cached"] != n // chunk * chunk:
            bad.append(f"compute {n}: vLLM's prefix cache held {s['cached']} tokens, expected the prefix")
    load_alone = _median([s.get("load", {}).get("total") for s in raw["whole"]])
    compute = _median([s["s"] for s in raw["compute"]])
    bound = max(load_alone, compute) if load_alone is not None and compute is not None else None
    row = LayerwiseRow(n, suffix, whole_s=_median([s["s"] for s in raw["whole"]]),
                       layerwise_s=_median([s["s"] for s in raw["layerwise"]]), load_alone_s=load_alone,
                       compute_alone_s=compute, cold_s=_median([s["s"] for s in raw["cold"]]),
                       layerwise_wait_s=_median([s.get("load", {}).get("wait") for s in raw["layerwise"]]),
                       cold_save_s=_median([_save_s(s) for s in raw["cold"]]),
                       samples={k: [{x: s.get(x) for x in ("s", "cached", "load")} for s in v] for k, v in raw.items()})
    row.whole_vs_bound, row.layerwise_vs_bound = _ratio(row.whole_s, bound), _ratio(row.layerwise_s, bound)
    row.layerwise_vs_whole = _ratio(row.layerwise_s, row.whole_s)
    return row, bad


def run_layerwise(model: str, workdir: Path, lengths: list[int], suffix: int, *, repeats: int, dtype: str,
                  timeout_s: float, command: str, log, max_batched: int) -> LayerwiseReport:
    import shutil

    from kvtier.bench.ttft_engine import CHUNK
    from kvtier.bench.ttft_report import machine_description

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    out = workdir / "layerwise.json"
    report = LayerwiseReport(command, machine_description(), model, dtype, repeats, max_batched,
                             engine_config(workdir / "kvtier"))
    cmd = [sys.executable, "-m", "kvtier.bench.ttft_layerwise", "--model", model, "--dtype", dtype,
           "--lengths", ",".join(map(str, lengths)), "--suffix", str(suffix), "--repeats", str(repeats),
           "--dir", str(workdir), "--out", str(out), "--max-batched", str(max_batched)]
    log(f"layerwise: one engine, {repeats} prefixes of {lengths} tokens + {suffix}-token suffixes")
    t0 = time.time()
    with open(workdir / "engine.log", "w") as lf:
        rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"the layerwise engine exited with {rc}; see {workdir / 'engine.log'}")
    log(f"layerwise: engine done in {time.time() - t0:.0f} s")
    raw = json.loads(out.read_text())
    for n in lengths:
        row, bad = summarize(n, suffix, raw["rows"][str(n)], CHUNK)
        report.rows.append(row)
        report.violations += bad
    return report


def report_json(report: LayerwiseReport) -> dict:
    return asdict(report)


def report_markdown(report: LayerwiseReport) -> str:
    def f(x, digits=3):
        return "—" if x is None else f"{x:.{digits}f}"

    lines = [f"# Layer-pipelined loads: SSD hit + new suffix ({report.model.split('/')[-1]}, {report.dtype})", "",
             f"Command: `{report.command}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in report.machine.items()), "",
             f"One engine, SSD tier only, chunk files evicted from the page cache before each hit; median of "
             f"{report.repeats} prefixes; max_num_batched_tokens={report.max_num_batched_tokens}. Times in "
             "seconds. bound = max(load alone, suffix compute alone).", "",
             "| prefix + suffix | cold | whole | layerwise | load alone | suffix compute alone | whole / bound "
             "| layerwise / bound | layerwise / whole | layerwise: forward waited | cold: save time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.rows:
        lines.append(f"| {r.prefix_tokens} + {r.suffix_tokens} | {f(r.cold_s)} | {f(r.whole_s)} | "
                     f"{f(r.layerwise_s)} | {f(r.load_alone_s)} | {f(r.compute_alone_s)} | {f(r.whole_vs_bound)} | "
                     f"{f(r.layerwise_vs_bound)} | {f(r.layerwise_vs_whole)} | {f(r.layerwise_wait_s)} | "
                     f"{f(r.cold_save_s)} |")
    if report.violations:
        lines += ["", "SAMPLES THAT DID NOT LOAD WHAT THEY CLAIM (figures invalid):", ""]
        lines += [f"- {v}" for v in report.violations]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(engine_main(sys.argv[1:]))
