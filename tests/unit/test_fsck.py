"""``kvtier fsck``: a crashed writer's directory, a corrupted chunk, a stale manifest; quarantine
instead of delete; usage against the budget; ``--json``. fsck uses the disk tier's own layout,
ledger lock and manifest code (kvtier/tiers/disklayout.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from kvtier.chunk import HEADER_SIZE, ChunkMeta
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers import manifest
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disklayout import NamespaceDir
from kvtier.tiers.fsck import check

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 5_000
KEYS = chunk_keys(NS, list(range(4 * 8)))
ROOT = Path(__file__).resolve().parents[2]


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()


def fill(path: Path, n: int = 8) -> DiskTier:
    t = DiskTier.open(path, NS, 10**9, telemetry=Telemetry())
    for i in range(n):
        assert t.put(ChunkMeta(KEYS[i], KEYS[i - 1] if i else None, 4, (P,), "uint8", P), payload(i))
    return t


def _fsck_cli(*args: str):
    from kvtier.commands import store_cmd
    import typer
    app = typer.Typer()
    store_cmd.register(app)
    app.command("noop")(lambda: None)          # two commands: typer keeps "fsck" as a sub-command
    return CliRunner().invoke(app, ["fsck", *args])


CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from kvtier.chunk import ChunkMeta
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers.disk import DiskTier
    NS = Namespace("m", "f", "float32", "L", 4, 4)
    keys = chunk_keys(NS, list(range(32)))
    real, published = os.replace, [0]
    def replace(src, dst):
        if str(dst).endswith(".kvc"):
            if published[0] == 3:                  # the 4th publish: crash here, temp file written
                print("writing", flush=True)
                time.sleep(600)
            published[0] += 1
        return real(src, dst)
    os.replace = replace
    t = DiskTier.open(sys.argv[1], NS, 10**9)
    for i, k in enumerate(keys):
        p = np.random.default_rng(i).integers(0, 256, 5000, dtype=np.uint8).tobytes()
        t.put(ChunkMeta(k, keys[i - 1] if i else None, 4, (5000,), "uint8", 5000), p)
""")


def test_crashed_writer_directory(tmp_path):
    """A writer SIGKILLed between writing its temp file and publishing it (holding the ledger lock)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    nsdir = NamespaceDir.all_under(tmp_path)[0]
    assert len(list(nsdir.tmp.iterdir())) == 1                    # the dead writer's temp file
    dry = check(tmp_path, repair=False, capacity=10**9)
    assert not dry.clean and len(dry.temp_files) == 1 and dry.ok == 3 and not dry.bad and not dry.orphans
    fixed = check(tmp_path, capacity=10**9)                       # the lock died with the writer
    assert fixed.removed == 1 and list(nsdir.tmp.iterdir()) == []
    again = check(tmp_path, capacity=10**9)
    assert again.clean and again.ok == 3
    t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    assert t.usage().num_chunks == 3 and t.usage().used_bytes == again.bytes_ok
    t.close()


def test_corrupted_chunk_quarantined_not_deleted(tmp_path):
    t = fill(tmp_path)
    t.close()
    victim = Path(t.path_of(KEYS[5]))
    with open(victim, "r+b") as f:                                 # bit rot: 5 is bad, 6 and 7 orphans
        f.seek(HEADER_SIZE + 17)
        f.write(b"\x00\x01\x02")
    q = tmp_path.parent / f"{tmp_path.name}-quarantine"
    r = _fsck_cli(str(tmp_path), "--quarantine", str(q), "--json", "-")
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)
    assert list(rep["bad"].values()) == ["corrupt"] and len(rep["orphans"]) == 2
    assert rep["quarantined"] == 3 and rep["removed"] == 0 and not victim.exists()
    moved = sorted(p.name for p in q.rglob("*.kvc"))
    assert moved == sorted(f"{KEYS[i].hex()}.kvc" for i in (5, 6, 7))
    assert (q / NS.short_id() / "chunks" / KEYS[5].hex()[:2] / f"{KEYS[5].hex()}.kvc").read_bytes()[:4] == b"KVTC"
    assert check(tmp_path).clean


def test_stale_manifest_reported_and_rewritten(tmp_path):
    t = fill(tmp_path)
    t.close()                                                      # close writes the manifest (8 entries)
    nsdir = NamespaceDir.all_under(tmp_path)[0]
    assert len(manifest.load(nsdir.manifest)) == 8
    for i in (6, 7):                                               # removed behind the manifest's back
        os.unlink(t.path_of(KEYS[i]))
    rep = check(tmp_path, repair=False)
    assert list(rep.stale_manifests.values()) == ["2 entries without a valid chunk, 0 with another parent"]
    assert rep.ledger_wrong and not rep.clean
    fixed = check(tmp_path)
    assert fixed.manifests_rewritten == 1 and fixed.ledger_fixed == 1
    assert sorted(manifest.load(nsdir.manifest)) == sorted(KEYS[:6])
    nsdir.manifest.write_bytes(b"garbage, not a manifest")
    assert list(check(tmp_path, repair=False).stale_manifests.values()) == ["damaged (checksum or length)"]
    check(tmp_path)
    assert check(tmp_path).clean


def test_usage_against_the_budget(tmp_path):
    t = fill(tmp_path)
    t.close()
    used = sum(os.stat(t.path_of(k)).st_size for k in KEYS[:8])
    ok = check(tmp_path, capacity=used)
    assert ok.clean and ok.usage[0].bytes_on_disk == used == ok.usage[0].ledger
    over = check(tmp_path, capacity=used - 1)
    assert over.over_budget == [NS.short_id()] and not over.clean
    cfg = tmp_path.parent / f"{tmp_path.name}.yaml"
    cfg.write_text(f"store:\n  disk: {{capacity: {used // 2}}}\n")
    r = _fsck_cli(str(tmp_path), "--config", str(cfg), "--dry-run")
    assert r.exit_code == 1 and "OVER BUDGET" in r.stdout
    r = _fsck_cli(str(tmp_path), "--quarantine", str(tmp_path / "q"))
    assert r.exit_code == 2 and "outside the cache directory" in r.stderr
