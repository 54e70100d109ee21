"""The targets and the Markdown report of one ``kvtier bench store`` run (side-effect free)."""

from __future__ import annotations

import time

from kvtier.bench.disk_attribution import fig, attribution_markdown
from kvtier.bench.store_bench_rounds import HEADLINE, WRITER_THREADS


def targets(r: dict) -> dict:
    """Each target per model: the median per-round ratio (and its min) against the threshold."""
    out = {}
    for name, d in r["models"].items():
        for key, ratio, thr in (("memory_get", d["memory"]["get_vs_memcpy"], 0.5),
                                ("disk_get", d["disk"]["get_vs_raw_read"], 0.9),
                                ("disk_put", d["disk"]["put_vs_raw_write"], 0.8)):
            out[f"{name}.{key}"] = {"ratio_median": ratio["median"], "ratio_min": ratio["min"], "target": thr,
                                    "met": ratio["median"] >= thr}
        # the store's own put path (TieredStore.put -> writer pool) against raw O_DIRECT writes at the
        # same concurrency, measured back to back in each round
        pool = d["disk"]["variants"].get("direct_async", {}).get(f"put_vs_raw_write_qd{WRITER_THREADS}")
        if pool:
            out[f"{name}.disk_put_store_path"] = {"ratio_median": pool["median"], "ratio_min": pool["min"],
                                                  "target": 0.8, "met": pool["median"] >= 0.8}
    out["lookup_ms_128_chunks"] = {"value": r["lookup_ms_128_chunks"], "target": 1.0,
                                   "met": r["lookup_ms_128_chunks"] <= 1.0}
    return out


def to_markdown(r: dict) -> str:
    """A human report of one run (machine, command, figures vs raw baselines and targets)."""
    m = r["machine"]
    n_rounds = r.get("repeat", 1)
    lines = [f"# kvtier store benchmark ({time.strftime('%Y-%m-%d', time.gmtime(r.get('time', time.time())))})", "",
             f"Command: `{r.get('command', 'kvtier bench store')}`", "",
             f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_kib'] / 2**20:.1f} GiB RAM, kernel {m['kernel']},"
             f" Python {m['python']}; disk under test ({m['fs_type']}):", "", "```", m["df"], "```", "",
             f"Volume per model per disk pass: {r['volume_bytes'] / 2**20:.0f} MiB; {n_rounds} rounds; in each round "
             "the raw pass and the O_DIRECT tier pass run back to back (order alternating), so both see the same "
             "disk state. Disk files are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before every read "
             "pass; puts are timed until written back (sync). Raw baselines: memcpy between pre-faulted buffers; sequential O_DIRECT write/read of the same "
             f"volume in chunk-sized blocks, one file, no checksum ({r['disk']['raw_tool']}). The store puts with "
             "`DiskTier.put` (one thread, queue depth 1, checksum + temp file + publish per chunk) and reads with "
             "`get_into` (checksum verified). Figures: median (min–max) over the rounds, GB/s; ratios: median "
             "(min–max) of the per-round ratios, and in brackets the ratio of the medians.", "",
             "| model | chunk | tier | get GB/s | baseline GB/s | get ratio (target) | put GB/s | baseline GB/s "
             "| put ratio (target) | get p50/p99 ms | put p50/p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, d in r["models"].items():
        mb = f"{d['chunk_bytes'] / 2**20:.2f} MiB"
        me, di = d["memory"], d["disk"]
        gs, ps = me["get_vs_memcpy"], me["put_vs_memcpy"]
        lines.append(f"| {name} | {mb} | memory | {fig(me['spread']['get_gbps'])} | memcpy "
                     f"{fig(me['spread']['memcpy_gbps'])} | **{fig(gs)}** [{gs['of_medians']}] (≥0.5) | "
                     f"{fig(me['spread']['put_gbps'])} | memcpy {fig(me['spread']['memcpy_put_gbps'])} | "
                     f"{fig(ps)} [{ps['of_medians']}] | {me['get']['p50_ms']}/{me['get']['p99_ms']} | "
                     f"{me['put']['p50_ms']}/{me['put']['p99_ms']} |")
        rr, rw = fig(di["spread"]["raw_read_gbps"]), fig(di["spread"]["raw_write_gbps"])
        for v, t in di["variants"].items():
            g, p = t["get_vs_raw_read"], t["put_vs_raw_write"]
            head = v == r.get("headline_variant", HEADLINE)
            label = {"direct": "disk (O_DIRECT)", "direct_write": "disk (O_DIRECT write, buffered read)",
                     "direct_async": f"disk (O_DIRECT, put via the {WRITER_THREADS}-thread writer pool)",
                     "buffered": "disk (buffered)"}.get(v, v)
            gt, pt = (" (≥0.9)", " (≥0.8)") if head else ("", "")
            b = "**" if head else ""
            lines.append(f"| {name} | {mb} | {label} | {fig(t['spread']['get_gbps'])} | raw read {rr} | "
                         f"{b}{fig(g)}{b} [{g['of_medians']}]{gt} | {fig(t['spread']['put_gbps'])} | raw write {rw} | "
                         f"{b}{fig(p)}{b} [{p['of_medians']}]{pt} | {t['get']['p50_ms']}/{t['get']['p99_ms']} | "
                         f"{t['put']['p50_ms'] or '–'}/{t['put']['p99_ms'] or '–'} |")
    for name, d in r["models"].items():
        t = d["disk"]["variants"].get("direct_async")
        if t:
            q = t[f"put_vs_raw_write_qd{WRITER_THREADS}"]
            lines += ["", f"{name}: put through the writer pool ({WRITER_THREADS} threads, `submit` + `flush`, the path "
                      f"`TieredStore.put` takes) vs raw O_DIRECT writes at the same concurrency ({WRITER_THREADS} "
                      f"threads, own file each: {fig(d['disk']['spread'][f'raw_write_qd{WRITER_THREADS}_gbps'])} GB/s):"
                      f" {fig(q)} [{q['of_medians']}]."]
    lines += ["", "Raw reads at the tier's own concurrency and read mode (fresh files, `get_into`'s pieces in "
              "flight, no checksum) against each variant's get (a ratio above 1: that baseline was no ceiling):", ""]
    for name, d in r["models"].items():
        for v, t in d["disk"]["variants"].items():
            if "get_vs_raw_read_same_io" in t:
                lines.append(f"* {name} {v}: raw {fig(t['raw_read_same_io_gbps'])} GB/s, get ratio "
                             f"{fig(t['get_vs_raw_read_same_io'])} [{t['get_vs_raw_read_same_io']['of_medians']}]")
    lines += attribution_markdown(r, HEADLINE)
    if m.get("virtual_disk_note"):
        lines += ["", f"Note: {m['virtual_disk_note']}."]
    lines += ["", "Per-round figures (GB/s; raw read/write, then O_DIRECT tier get/put):", ""]
    for name, d in r["models"].items():
        di = d["disk"]
        h = di["variants"][r.get("headline_variant", HEADLINE)]["per_round"]
        lines.append(f"* {name}: raw read {di['per_round']['raw_read_gbps']}, get {h['get_gbps']}; "
                     f"raw write {di['per_round']['raw_write_gbps']}, put {h['put_gbps']}")
    rec = r.get("index_recovery", {})
    tg = r.get("targets", {})
    lines += ["", f"Memory first fill (slab allocation + page faults, once per process): "
              f"{r['models']['default']['memory']['first_fill_gbps']} GB/s (default model).", "",
              f"Lookup of a 32K-token prompt (128 chunks): {r['lookup_disk_ms_128_chunks']} ms median over "
              f"{r.get('lookup_reps', 200)} lookups with every chunk on disk, warm metadata (p99 "
              f"{r['lookup_disk_p99_ms']} ms); cold metadata (first lookup of a reopened store, kernel caches "
              f"{'dropped' if r.get('lookup_disk_cold_caches_dropped') else 'NOT dropped (not allowed)'}): "
              f"{r.get('lookup_disk_cold_ms_128_chunks')} ms; "
              f"{r['lookup_memory_ms_128_chunks']} ms in RAM (target ≤ 1 ms). Key "
              f"hashing for those 32K tokens, separately: {r['keys_ms_32k_tokens_numpy']} ms from a numpy array, "
              f"{r['keys_ms_32k_tokens_list']} ms from a Python list.", "",
              f"Index recovery at open for {rec.get('chunks')} chunk files: {rec.get('open_s_no_manifest')} s reading "
              f"every header, {rec.get('open_s_with_manifest')} s with the manifest.", ""]
    if tg:
        lines += ["Targets (median of per-round ratios; min in brackets):", ""]
        for k, t in tg.items():
            val = f"{t['ratio_median']} (min {t['ratio_min']})" if "ratio_median" in t else f"{t['value']} ms"
            lines.append(f"* {k}: {val}, target {'≥' if 'ratio_median' in t else '≤'} {t['target']}: "
                         f"{'met' if t['met'] else 'MISSED'}")
        lines.append("")
    if "sharedfs" in r:
        from kvtier.bench.store_bench_sharedfs import markdown_rows
        lines += markdown_rows(r["sharedfs"])
    if "duration_s" in r:
        lines += [f"Bench duration: {r['duration_s']} s.", ""]
    from kvtier.bench.store_bench_shared import shared_markdown  # rows of --shared (services helper)
    lines += shared_markdown(r)
    return "\n".join(lines)
