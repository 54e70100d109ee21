"""Seeding a shared backend from a writer engine's SSD chunk files (kvtier/bench/shared_seed.py),
and the shared-tier rows of `kvtier bench ttft` that read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.shared_seed import SharedTarget, _chain_order, seed_shared, shared_config
from kvtier.config import ConfigError
from kvtier.metrics import Telemetry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.protocol import Deadline
from tests.unit.sharedfs_helpers import NS, chain, open_tier


def _ssd(tmp_path: Path, chains: list) -> Path:
    d = tmp_path / "ssd"
    tier = DiskTier.open(d, NS, 1 << 30, telemetry=Telemetry())
    for ch in chains:
        for meta, payload in ch:
            assert tier.put(meta, payload)
    tier.flush(30)
    tier.close()
    return d


def test_seed_copies_every_chunk_byte_exact_and_reads_the_chains_back(tmp_path: Path) -> None:
    a, b = chain(3, seed=1), chain(2, seed=2)
    ssd = _ssd(tmp_path, [a, b])
    res = seed_shared(ssd, {"kind": "sharedfs", "path": str(tmp_path / "shared"), "create": True,
                            "janitor": False}, log=lambda m: None)
    assert (res.chunks, res.refused, res.skipped, res.readable, res.ok) == (5, 0, [], 5, True)
    assert res.nbytes == sum(m.payload_len for m, _ in a + b)
    tier = open_tier(tmp_path / "shared")
    try:
        assert tier.longest_prefix([m.key for m, _ in a], Deadline.after(5)).num_chunks == 3
        for meta, payload in a + b:
            buf = memoryview(bytearray(meta.payload_len))
            r = tier.read_into([meta.key], [buf], Deadline.after(5))[0]
            assert r.ok and bytes(buf) == payload and r.meta.parent == meta.parent
    finally:
        tier.close()


def test_a_corrupt_file_is_skipped_not_copied(tmp_path: Path) -> None:
    a = chain(2, seed=3)
    ssd = _ssd(tmp_path, [a])
    f = next(ssd.rglob(a[1][0].key.hex() + ".kvc"))
    data = bytearray(f.read_bytes())
    data[-40] ^= 0xFF                               # one payload byte flipped: the checksum no longer holds
    f.write_bytes(bytes(data))
    res = seed_shared(ssd, {"kind": "sharedfs", "path": str(tmp_path / "shared"), "create": True,
                            "janitor": False}, log=lambda m: None)
    assert res.chunks == 1 and len(res.skipped) == 1 and a[1][0].key.hex() in res.skipped[0]
    tier = open_tier(tmp_path / "shared")
    try:
        assert tier.longest_prefix([m.key for m, _ in a], Deadline.after(5)).num_chunks == 1
    finally:
        tier.close()


def test_parents_are_written_before_children() -> None:
    a = chain(4, seed=5)
    metas = {m.key: m for m, _ in reversed(a)}
    order = _chain_order(metas)
    assert order == [m.key for m, _ in a]


def test_target_configs_are_validated_with_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shared tier config"):
        shared_config({"kind": "valkey", "io_timeout_s": -1})
    with pytest.raises(ConfigError, match="differs"):
        SharedTarget("valkey", {"kind": "valkey"}, {"kind": "mooncake"})
    t = SharedTarget("sharedfs", {"kind": "sharedfs", "path": str(tmp_path)}, {"kind": "sharedfs", "path": "/x"})
    assert json.loads(json.dumps(t.to_json()))["read"]["path"] == "/x"


def test_shared_reader_rows_are_checked_against_the_shared_tier() -> None:
    from kvtier.bench.ttft_engine import _check

    # a 1024-token prompt: 4 stored chunks, vLLM takes 896 tokens (the last block is computed)
    good = {"s": 1.0, "cached": 896, "reset_ok": True,
            "kvtier": {"kvtier_connector_loaded_tokens_total": 896.0, "kvtier_store_hits_total{tier=valkey}": 4.0}}
    assert _check("shared-r:valkey", {"shared_hit": [good]}, 1024, 256, 128) == []
    local = dict(good, kvtier={"kvtier_connector_loaded_tokens_total": 896.0,
                               "kvtier_store_hits_total{tier=memory}": 4.0})
    bad = _check("shared-r:valkey", {"shared_hit": [local]}, 1024, 256, 128)
    assert any("0 tokens admitted from the shared tier" in b for b in bad)
    assert any("served by the memory tier, not valkey" in b for b in bad)


def test_repeats_per_length() -> None:
    from kvtier.bench.ttft_engine import parse_repeats

    assert parse_repeats("3", [1024, 4096]) == {1024: 3, 4096: 3}
    assert parse_repeats("3,2,1", [1024, 4096, 8192]) == {1024: 3, 4096: 2, 8192: 1}
    for bad in ("3,2", "0", "1,2,3,4"):
        with pytest.raises(ValueError):
            parse_repeats(bad, [1024, 4096, 8192])


def test_resume_takes_earlier_roles_and_reports_shared_columns(tmp_path: Path, monkeypatch) -> None:
    """A run split into jobs: the second invocation runs only a shared reader; the vanilla and
    writer results come from the first one's files."""
    import kvtier.bench.ttft as ttft
    from kvtier.bench.ttft_report import report_markdown

    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "vanilla.json").write_text(json.dumps({"rows": {"1024": {"cold": [{"s": 4.0}], "apc_hit": [{"s": 0.4}]}},
                                                 "block_size": 128, "chunk_size": 256}))
    (wd / "kvtier-w.json").write_text(json.dumps({"rows": {"1024": {"cold": [{"s": 4.1}], "ram_hit": [{"s": 0.5}]}}}))
    ran = []

    def fake_engine(role, model, dtype, lengths, reps, root, limit, log, max_batched, extra=()):
        ran.append((role, extra))
        return {"rows": {"1024": {"shared_hit": [{"s": 0.9}]}}}, None

    monkeypatch.setattr(ttft, "_run_engine", fake_engine)
    monkeypatch.setattr(ttft, "_seed", lambda target, workdir, log: {"chunks": 4, "ok": True, "readable": 4})
    monkeypatch.setattr(ttft, "kv_bytes_per_token", lambda model, dtype: 1000)
    monkeypatch.setattr(ttft, "_ideal_read", lambda *a: None)
    target = SharedTarget("valkey", {"kind": "valkey"}, {"kind": "valkey"})
    rep = ttft.run_ttft(str(tmp_path), wd, [1024], repeats=1, dtype="float32", roles=("shared-r:valkey",),
                        shared=(target,), resume=True, log=lambda m: None)
    assert [r for r, _ in ran] == ["shared-r:valkey"] and "--shared" in ran[0][1]
    assert json.loads((wd / "shared-valkey.json").read_text()) == {"kind": "valkey"}
    row = rep.rows[0]
    assert (row.vanilla_s, row.kvtier_ram_s, row.shared_hit_s) == (4.0, 0.5, {"valkey": 0.9})
    assert sorted(rep.resumed_roles) == ["kvtier-w", "vanilla"] and rep.violations == []
    md = report_markdown(rep)
    assert "kvtier valkey hit (fresh engine, empty local tiers)" in md and "earlier invocation" in md
    assert md.splitlines()[[i for i, l in enumerate(md.splitlines()) if l.startswith("| 1024")][0]].endswith(
        "0.900 |")


def test_a_role_rerun_on_other_lengths_keeps_its_earlier_rows() -> None:
    from kvtier.bench.ttft import merge_rows

    earlier = {"rows": {"1024": {"cold": [{"s": 4}]}, "4096": {"cold": [{"s": 9}]}},
               "violations": ["cold 4096: partial", "ram_hit 1024: bad"], "diag": {"length": 1024}}
    now = {"rows": {"4096": {"cold": [{"s": 30}]}, "8192": {"cold": [{"s": 90}]}}, "violations": []}
    m = merge_rows(earlier, now)
    assert m["rows"] == {"1024": {"cold": [{"s": 4}]}, "4096": {"cold": [{"s": 30}]}, "8192": {"cold": [{"s": 90}]}}
    assert m["violations"] == ["ram_hit 1024: bad"] and m["diag"] == {"length": 1024}
    assert merge_rows(earlier, None) is earlier


def test_a_cold_row_that_hit_a_cache_is_a_violation() -> None:
    from kvtier.bench.ttft_engine import _check

    assert _check("vanilla", {"cold": [{"s": 4.0, "cached": 0}]}, 1024, 256, 128) == []
    bad = _check("kvtier-w", {"cold": [{"s": 0.5, "cached": 896, "kvtier": {}}]}, 1024, 256, 128)
    assert any("cold 1024: 896 tokens came from a cache" in b for b in bad)
