"""The shared-FS column of `kvtier demo longdoc --shared sharedfs`, alone and instrumented.

    timeout 600 .venv/bin/python benchmarks/shared_tiers/sharedfs_engine_probe.py \
        --from /tmp/longdoc-shared/longdoc --json /tmp/engine-probe.json [--kvtier '{"connector": {...}}']

Reuses a finished long-document run (``--from``: its ``ssd/`` chunk files and ``workload.jsonl``):
starts a fresh JuiceFS volume mounted twice (``services.py``), seeds it from those chunks through
mount a exactly as the demo does, then starts one fresh server with empty local tiers reading
mount b (the demo's server 3 config, plus ``--kvtier`` merged in) and asks each document's
shared-FS question, the volume's data directory evicted from the page cache first. No recompute
runs, so one pass takes ~1.5 minutes instead of the demo's ~10.

Per document, besides TTFT and the demo's hit checks: the worker's shared-FS read seconds
(kvtier metrics), the JuiceFS client's own gauges while it loads (``<mount>/.stats``: read buffer,
RSS), CPU seconds of every thread of the server's processes and of the JuiceFS client (from
/proc), and, with ``--pyspy`` (needs ``.venv/bin/pip install py-spy``; set-up does not install it), ``py-spy dump``
of the worker 1.5 s and 3 s into the request.
Side effects: its own services and server in a temp dir; nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from services import READER_MOUNT_OPTIONS, services  # noqa: E402
from sharedfs_load_probe import StatsSampler  # noqa: E402

SHARED_COLUMN = 3        # the demo's question index of the shared-FS column (after recompute, RAM, SSD)


def threads_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds per (process name / thread name) of every thread of ``pids``."""
    tck = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        try:
            pname = open(f"/proc/{pid}/comm").read().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    raw = open(f"/proc/{pid}/task/{tid}/stat").read()
                except OSError:
                    continue
                tname = raw[raw.index("(") + 1:raw.rindex(")")]
                f = raw.rsplit(")", 1)[1].split()
                key = f"{pid}:{pname}/{tname}"
                out[key] = out.get(key, 0.0) + (int(f[11]) + int(f[12])) / tck
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    import psutil
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return [pid]


def worker_pid(server_pid: int) -> int | None:
    """The vLLM worker process (the one that runs kvtier's loader) among the server's children."""
    import psutil
    for pid in descendants(server_pid)[1:]:
        try:
            if "Worker" in " ".join(psutil.Process(pid).cmdline()) or "Worker" in psutil.Process(pid).name():
                return pid
        except psutil.Error:
            continue
    kids = descendants(server_pid)
    return kids[-1] if len(kids) > 1 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", type=Path, required=True, help="a finished `demo longdoc` out dir")
    ap.add_argument("--kvtier", default="{}", help="JSON merged into the reading server's kvtier config")
    ap.add_argument("--reader-cache", action="store_true", help="mount b with JuiceFS's default block cache")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    pyspy = Path(sys.executable).parent / "py-spy"
    if a.pyspy and not pyspy.exists():
        print(f"--pyspy: {pyspy} not found (.venv/bin/pip install py-spy)", file=sys.stderr)
        return 2

    from kvtier.bench.shared_seed import SharedTarget, evict, reader_config, seed_shared
    from kvtier.config import deep_merge
    from kvtier.demo.longdoc import DEMO_CHUNK_TOKENS, _metrics_port, _one, _scrape, _warm_up
    from kvtier.compute import choose_dtype
    from kvtier.demo.common import model_facts
    from kvtier.model import ensure_model
    from kvtier.server import ServerSpec, VllmServer
    from kvtier.workload.format import load_workload

    wl = load_workload(a.src / "workload.jsonl")
    by_doc: dict[str, list] = {}
    for c in wl.conversations:
        by_doc.setdefault(c.metadata["doc"], []).append(c)
    facts = model_facts(ensure_model(), choose_dtype().dtype)
    size = json.loads((a.src / "demo-longdoc.json").read_text())["size"]
    result: dict = {"from": str(a.src), "kvtier": json.loads(a.kvtier), "docs": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-probe-") as tmp, \
            services(Path(tmp), 0, {"sharedfs"}, () if a.reader_cache else READER_MOUNT_OPTIONS) as ep:
        base = {"kind": "sharedfs", "janitor": False}
        target = SharedTarget("sharedfs", {**base, "path": str(ep.write_dir)}, {**base, "path": str(ep.read_dir)},
                              (str(ep.data_dir),))
        seeded = seed_shared(a.src / "ssd", target.write, log=lambda m: None)
        print(f"seeded {seeded.chunks} chunks in {seeded.seconds:.1f} s", flush=True)
        port = _metrics_port()
        kv = {"store": {"chunk_size": DEMO_CHUNK_TOKENS, "memory": {"capacity": 2 * 2**30},
                        "disk": {"enabled": False}, "shared": reader_config(target.read)},
              "metrics": {"port": port}}
        kv = deep_merge(kv, json.loads(a.kvtier))
        spec = ServerSpec(name="kvtier-probe", model=str(facts.path), dtype=facts.dtype,
                          max_model_len=size["max_prompt_length"] + 64, max_num_batched_tokens=2048,
                          kv_cache_space_gib=1, enable_prefix_caching=False, kvtier_config=kv)
        mount_b = ep.handles["mount_b"]
        jfs_pids = descendants(mount_b.pid)
        with VllmServer.start(spec, Path(tmp) / "server.log") as s:
            _warm_up(s.base_url)
            server_pids = descendants(s.process.pid)
            wpid = worker_pid(s.process.pid)
            print(f"server pids {server_pids}, worker {wpid}, juicefs {jfs_pids}", flush=True)
            for doc, qs in by_doc.items():
                evict(target.evict)
                time.sleep(1.0)
                before = threads_cpu(server_pids + jfs_pids)
                sampler = StatsSampler(mount_b.path)
                dumps: list[str] = []
                if a.pyspy and wpid:
                    def spy(t0: float = time.monotonic()) -> None:
                        for at in (1.5, 3.0):          # seconds into the request
                            time.sleep(max(0.0, t0 + at - time.monotonic()))
                            r = subprocess.run([str(pyspy), "dump", "--pid", str(wpid)],
                                               capture_output=True, text=True, timeout=30)
                            dumps.append(f"--- {at} s\n{r.stdout}{r.stderr}")
                    threading.Thread(target=spy, daemon=True).start()
                rec, admitted, read = _one(s.base_url, qs[SHARED_COLUMN], port)
                jfs = sampler.stop()
                after = threads_cpu(server_pids + jfs_pids)
                cpu = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items() if v - before.get(k, 0.0) >= 0.05}
                get_s = _scrape(f"http://127.0.0.1:{port + 1}/metrics", "kvtier_store_get_seconds_sum").get("sharedfs")
                row = {"doc": doc, "ttft_s": round(rec.ttft_s, 3), "cached_tokens": rec.cached_tokens,
                       "chunks_read": read, "admitted": admitted, "sharedfs_get_seconds_sum_total": get_s,
                       "juicefs": jfs, "cpu_s": dict(sorted(cpu.items(), key=lambda kv_: -kv_[1])),
                       "pyspy": dumps}
                result["docs"].append(row)
                print(f"{doc}: TTFT {rec.ttft_s:.2f} s, cached {rec.cached_tokens}, get_s {get_s}, jfs {jfs}", flush=True)
                print("   cpu: " + ", ".join(f"{k} {v}" for k, v in list(row["cpu_s"].items())[:12]), flush=True)
    result["loadavg"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
