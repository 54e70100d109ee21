"""The ``kvtier bench encoding`` report as Markdown (the JSON is ``EncodingReport.to_json()``). Pure."""

from __future__ import annotations

from kvtier.bench.encoding_bench import EncodingReport
from kvtier.units import percent


def _f(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _g(v) -> str:
    """Three significant digits: a float32 noise floor (1e-6) and a lossy shift (1e-2) both readable."""
    return "—" if v is None else f"{v:.3g}"


def codec_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["## Codecs on real chunks", "", "Every captured chunk, one thread; ratio = plain payload bytes / encoded "
           "payload bytes; MB/s of plain KV.", "",
           "| dtype | encoding | chunks | plain B/token | encoded B/token | ratio | encode MB/s | decode MB/s | check |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = (f"rel. RMS error {r['rel_rms_error_mean']:.2e} mean, {r['rel_rms_error_max']:.2e} max"
                 if r["encoding"] == "int8" else "byte-exact" if r.get("exact") else "NOT EXACT")
        out.append(f"| {r['dtype']} | {r['encoding']} | {r['chunks']} | {_f(r['plain_bytes_per_token'], 0)} | "
                   f"{_f(r['bytes_per_token'], 0)} | {r['ratio']:.3f} | {_f(r['encode_mbps'], 0)} | "
                   f"{_f(r['decode_mbps'], 0)} | {check} |")
    return out + [""]


def store_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["## Real stores", "", f"Medians of {rows[0]['rounds']} rounds, encodings interleaved within each; "
           "stored = what the backend holds per token (header + frame + trailer); get = plain KV delivered "
           "(verified, decoded), 2 callers, one chunk per call; ratios vs plain from the same rounds.", "",
           "| backend | dtype | encoding | chunks | stored B/token | stored vs plain | put MB/s | get MB/s | "
           "get chunks/s | get vs plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['backend']} | {r['dtype']} | {r['encoding']} | {r['chunks']} | "
                   f"{_f(r['stored_bytes_per_token'], 0)} | {_f(r.get('stored_vs_plain'), 3)} | {_f(r['put_mbps'], 0)} | "
                   f"{_f(r['get_mbps'], 0)} | {_f(r['get_chunks_per_s'], 1)} | {_f(r.get('get_vs_plain'), 3)} |")
    return out + [""]


def quality_lines(report: EncodingReport) -> list[str]:
    if not report.quality:
        return []
    p = report.prompts
    n = next(iter(report.quality.values()))["tokens"]
    out = ["## Output against float32 recompute", "",
           f"{p['count']} prompts of {p['min_tokens']}-{p['max_tokens']} tokens, {n} greedy tokens each (float32); "
           "the prompt's prefix loaded from a sharedfs tier in the encoding vs vLLM without kvtier. |Δ logprob|: "
           "chosen tokens at the positions before the first divergence.", "",
           "| encoding | identical outputs | tokens before divergence | equal positions | mean abs Δ logprob | "
           "max abs Δ logprob | first token abs Δ logprob | loads proved | tokens loaded |",
           "|---|---|---|---|---|---|---|---|---|"]
    for enc, q in report.quality.items():
        out.append(f"| {enc} | {q['identical']} / {q['prompts']} ({percent(q['identical_share'])}) | "
                   f"{percent(q['prefix_share'])} | {percent(q['position_share'])} | {_g(q['mean_abs_dlogprob'])} | "
                   f"{_g(q['max_abs_dlogprob'])} | {_g(q['first_token_abs_dlogprob'])} | "
                   f"{q['proved_prompts']} / {q['prompts']} | {q['loaded_tokens']:,} of {q['prompt_tokens']:,} |")
    return out + [""]


def report_markdown(report: EncodingReport) -> str:
    m = report.machine
    lines = ["# kvtier bench encoding", "", f"Command: `{report.command}`", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cpus')} CPUs ({m.get('cpu_capability')}), vLLM {m.get('vllm')}, "
             f"torch {m.get('torch')}; model {report.model}", "",
             "Roles: " + ", ".join(f"{k} {v}" for k, v in report.roles.items()), ""]
    lines += codec_lines(report.codec) + store_lines(report.stores) + quality_lines(report)
    if report.violations:
        lines += ["## Violations", ""] + [f"- {v}" for v in report.violations] + [""]
    return "\n".join(lines)
