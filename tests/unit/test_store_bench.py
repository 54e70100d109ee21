"""`kvtier bench store`: round statistics, JSON keys the issue asks for, the CLI (tiny volumes)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtier.bench import (disk_attribution, store_bench, store_bench_disk, store_bench_files, store_bench_lookup,
                          store_bench_raw, store_bench_report, store_bench_rounds)
from kvtier.bench.store_bench_rounds import against_ceiling, order, ratio_stats, spread


def test_spread_and_ratio_of_rounds() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    r = ratio_stats([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])      # per-round ratios 0.5, 1.0, 1.5
    assert (r["median"], r["min"], r["max"], r["of_medians"]) == (1.0, 0.5, 1.5, 1.0)
    # a slow round hits both figures of that round: the per-round ratio is immune to it,
    # the ratio of medians is not
    r = ratio_stats([1.0, 1.0, 0.5], [1.0, 1.0, 0.5])
    assert r["median"] == 1.0 and r["min"] == 1.0
    with pytest.raises(ValueError):
        ratio_stats([1.0], [1.0, 2.0])


def test_slow_medium_keeps_its_digits() -> None:
    # a loaded machine or a network filesystem: 0.01-0.05 GB/s. Three decimals kept one or two digits
    # and the per-round ratio recomputed from the stored values was off by ~5% (seen in CI).
    get, raw = [0.01234, 0.01187, 0.01311], [0.04718, 0.04551, 0.04902]
    assert spread(get) == {"median": 0.01234, "min": 0.01187, "max": 0.01311}
    r = ratio_stats(get, raw)
    stored = [store_bench_rounds.sig(a) / store_bench_rounds.sig(b) for a, b in zip(get, raw)]
    assert r["median"] == pytest.approx(statistics.median(stored), rel=1e-3)


def test_raw_and_tier_alternate_order() -> None:
    assert [order(i, "raw", "tier") for i in range(4)] == [("raw", "tier"), ("tier", "raw")] * 2


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(store_bench, "MODELS", {"default": 256, "7b": 512})   # 64 / 128 KiB chunks
    monkeypatch.setattr(store_bench_lookup, "drop_kernel_caches", lambda: False)    # never drop the machine's caches here


def test_run_reports_medians_spreads_and_the_issue_keys(tmp_path: Path, tiny) -> None:
    logs: list[str] = []
    r = store_bench.run(tmp_path, volume=1 << 20, quick=True, log=logs.append, repeat=3,
                        recovery_chunks=20, lookup_reps=5)
    for dotted in ("memory.get_gbps", "memory.memcpy_gbps", "disk.get_gbps", "disk.put_gbps",
                   "disk.raw_read_gbps", "disk.raw_write_gbps"):
        section, key = dotted.split(".")
        assert r[section][key] > 0, dotted
    assert r["lookup_ms_128_chunks"] > 0 and r["lookup_disk_cold_ms_128_chunks"] > 0
    assert r["lookup_disk_cold_caches_dropped"] is False
    for name in ("default", "7b"):
        d = r["models"][name]["disk"]
        assert d["rounds"] == 3 and len(d["per_round"]["raw_read_gbps"]) == 3
        assert d["raw_read_gbps"] == pytest.approx(statistics.median(d["per_round"]["raw_read_gbps"]), rel=1e-3)
        for v in store_bench_rounds.VARIANTS:
            t = d["variants"][v]
            assert len(t["per_round"]["get_gbps"]) == 3
            for kind, fig in (("raw_read", "get_gbps"), ("raw_write", "put_gbps")):
                c = t[kind]                  # the report's raw figure: the best plain variant of each round
                assert set(c["variants"]) == set(store_bench_raw.READ_SHAPES if kind == "raw_read"
                                                 else store_bench_raw.WRITE_SHAPES[t[f"o_direct_{kind[4:]}"]])
                best = [max(c["variants_per_round"][k][i] for k in c["variants"]) for i in range(3)]
                assert c["per_round"] == best
                per_round = [a / b for a, b in zip(t["per_round"][fig], best)]
                ratio = t["get_vs_raw_read" if kind == "raw_read" else "put_vs_raw_write"]
                assert ratio["min"] <= ratio["median"] <= ratio["max"]
                assert ratio["median"] == pytest.approx(statistics.median(per_round), rel=0.02)
                assert c["rounds_above"] == [i for i in range(3) if per_round[i] > 1]
            assert t["raw_read_fresh_files_gbps"]["median"] > 0 and t["get_vs_device_read"]["median"] > 0
        assert d["get_gbps"] == d["variants"]["direct"]["get_gbps"]
        assert d["raw_write_gbps"] == d["variants"]["direct"]["raw_write_gbps"]
        assert d["device"]["read_gbps"]["median"] > 0 and d["device"]["write_gbps"]["median"] > 0
        h = d["variants"][store_bench_rounds.HEADLINE]   # the headline's own files, one read per chunk
        assert h["get_one_read_gbps"]["median"] > 0 and len(h["layout_per_round"]) == 3
        assert all(h["cpu_s_per_gb"][k]["median"] >= 0 for k in ("get", "get_one_read", "read_plan", "put",
                                                                 "write_publish", "write_padded"))
        assert "get_one_read_gbps" not in d["variants"]["buffered"]
        assert "write_padded" not in d["variants"]["buffered"]["cpu_s_per_gb"]
        assert d["verify"]["xxh3_128_gbps"] > 0 and d["verify"]["chunk_bytes"] == r["models"][name]["chunk_bytes"]
        m = r["models"][name]["memory"]
        assert m["spread"]["get_gbps"]["min"] <= m["get_gbps"] <= m["spread"]["get_gbps"]["max"]
    assert set(r["targets"]) >= {"default.disk_get", "7b.disk_put", "default.memory_get", "lookup_ms_128_chunks"}
    assert sum("round 3/3" in line for line in logs) == 2
    md = store_bench_report.to_markdown(r)
    assert "| 7b |" in md and "median" in md and ("MISSED" in md or ": met" in md)
    assert not (tmp_path / "raw.bin").exists() and not list((tmp_path / "raw-same-io").iterdir())
    assert not list(tmp_path.glob("raw-*/*"))                  # the plain variants' files are removed
    assert "NOT dropped" in md and "tier's own concurrency" in md and "CEILING" in md
    assert "best per round" in md and "one read per chunk" in md and "xxh3-128" in md


def test_raw_same_io_matches_the_tiers_reads_in_flight(tmp_path: Path, monkeypatch) -> None:
    """The same-io baseline runs as many reads in flight as get_into issues per chunk (header +
    pieces + tail: 3 for the default 5.6 MiB chunk), not the file's 2 MiB pieces alone (1)."""
    from kvtier.bench import rawread
    from kvtier.tiers import diskio
    seen = {}

    def fake(directory, file_bytes, files, reads_in_flight, piece_bytes, tries=3, o_direct=True):
        seen.update(inflight=reads_in_flight, piece=piece_bytes, fbytes=file_bytes)
        return rawread.RawRead(1.0, file_bytes * files, files, reads_in_flight, piece_bytes, o_direct, tries)
    monkeypatch.setattr(rawread, "best_raw_read", fake)
    chunk = 23_040 * 256
    store_bench_raw.raw_read_same_io(tmp_path, chunk, 2, o_direct=True)
    assert seen["inflight"] == len(diskio.read_plan(chunk, True)) == 3
    assert -(-seen["fbytes"] // seen["piece"]) == 3          # the file in 3 pieces, one per read


def test_file_layout_of_written_files(tmp_path: Path) -> None:
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(3 * 4096))
        paths.append(str(p))
    os.sync()
    lay = disk_attribution.file_layout(paths)
    if lay is None:                       # FIEMAP unsupported here (e.g. tmpfs, some containers)
        return
    assert lay["files"] == 3 and lay["extents"] >= 3 and 0 <= lay["breaks"] <= 2 and lay["span_mib"] >= 0


def test_verify_speed_reports_the_checksums() -> None:
    v = disk_attribution.verify_speed(memoryview(os.urandom(1 << 20)), reps=2)
    assert v["xxh3_128_gbps"] > 0 and v["chunk_bytes"] == 1 << 20
    assert v["blake3_mac_gbps"] is None or v["blake3_mac_gbps"] > 0


def test_buffered_puts_are_timed_until_written_back(tmp_path: Path, monkeypatch) -> None:
    import time

    real = os.sync

    def slow_sync() -> None:       # write-back that takes 0.3 s: it must be inside the put's timed region
        time.sleep(0.3)
        real()

    monkeypatch.setattr(store_bench_disk.os, "sync", slow_sync)
    res = store_bench_disk.bench_disk(tmp_path, 65536, 4, o_direct=False, o_direct_read=False)
    assert res["put_gbps"] <= 4 * 65536 / 0.3 / 1e9    # (before the fix: buffered puts never waited for it)


def test_virtual_disk_note_names_virtio_or_says_nothing(tmp_path: Path) -> None:
    note = store_bench_files.virtual_disk_note(tmp_path)
    assert note is None or "host may serve reads from its own cache" in note


def test_cli_writes_json_and_markdown_next_to_it(tmp_path: Path, monkeypatch, tiny) -> None:
    from kvtier.commands import store_cmd
    app = typer.Typer()
    bench = typer.Typer()
    app.add_typer(bench, name="bench")
    store_cmd.register(app)
    real = store_bench.run
    seen = {}

    def small(path, volume, quick, log=print, repeat=5):
        seen["repeat"] = repeat
        return real(path, 1 << 20, quick, log=log, repeat=repeat, recovery_chunks=10, lookup_reps=3)
    monkeypatch.setattr(store_bench, "run", small)
    out = tmp_path / "res" / "store.json"
    args = ["bench", "store", "--disk-path", str(tmp_path / "d"), "--repeats", "2", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["kvtier", *args])      # the command line the record names (not the runner's)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert seen["repeat"] == 2
    data = json.loads(out.read_text())
    assert data["repeat"] == 2 and data["command"] == "kvtier " + " ".join(args)
    assert (tmp_path / "res" / "store.md").read_text().startswith("# kvtier store benchmark")


def test_cli_rejects_zero_rounds(tmp_path: Path) -> None:
    from kvtier.commands import store_cmd
    app = typer.Typer()
    bench = typer.Typer()
    app.add_typer(bench, name="bench")
    store_cmd.register(app)
    res = CliRunner().invoke(app, ["bench", "store", "--disk-path", str(tmp_path), "--repeats", "0"])
    assert res.exit_code == 2


_fig = st.floats(0.01, 10.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rounds=st.integers(1, 6), nvariants=st.integers(1, 4))
def test_the_raw_figure_is_the_max_of_the_plain_variants(data, rounds: int, nvariants: int) -> None:
    variants = {f"v{j}": data.draw(st.lists(_fig, min_size=rounds, max_size=rounds)) for j in range(nvariants)}
    tier = data.draw(st.lists(_fig, min_size=rounds, max_size=rounds))
    c = against_ceiling(tier, variants)
    best = [max(v[i] for v in variants.values()) for i in range(rounds)]
    assert c["per_round"] == [store_bench_rounds.sig(b) for b in best]
    assert [variants[k][i] for i, k in enumerate(c["best_per_round"])] == best
    ratios = [t / b for t, b in zip(tier, best)]
    assert c["ratio"]["max"] == store_bench_rounds.sig(max(ratios))
    for v in variants.values():          # the ceiling is at least every variant: no ratio above the ratio to any
        assert all(t / b <= t / x * (1 + 1e-12) for t, b, x in zip(tier, best, v))
    assert c["rounds_above"] == [i for i in range(rounds) if tier[i] > best[i]]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rounds=st.integers(1, 6))
def test_a_tier_doing_the_plain_io_plus_work_never_exceeds_its_ceiling(data, rounds: int) -> None:
    """The tier's pass is one plain variant's work plus more (checksum, ledger, index): slower in
    every round. Then its ratio to the max over the variants cannot exceed 1, and no round is flagged."""
    plain = data.draw(st.lists(_fig, min_size=rounds, max_size=rounds))
    other = data.draw(st.lists(_fig, min_size=rounds, max_size=rounds))
    slower = data.draw(st.lists(st.floats(0.05, 1.0), min_size=rounds, max_size=rounds))
    tier = [p * f for p, f in zip(plain, slower)]
    c = against_ceiling(tier, {"publish": plain, "padded": other})
    assert c["ratio"]["max"] <= 1.0 and c["rounds_above"] == []


def test_ceiling_refuses_ragged_or_empty_variants() -> None:
    with pytest.raises(ValueError, match="at least one"):
        store_bench_rounds.ceiling({})
    with pytest.raises(ValueError, match="different numbers of rounds"):
        store_bench_rounds.ceiling({"a": [1.0, 2.0], "b": [1.0]})


def _synthetic(put_vs: float, above: list[int]) -> dict:
    ratio = {"median": put_vs, "min": put_vs, "max": put_vs, "of_medians": put_vs}
    ceil = {"rounds_above": above}
    variant = {"raw_read": {"rounds_above": []}, "raw_write": ceil, "put_vs_raw_write": ratio}
    disk = {"get_vs_raw_read": {**ratio, "median": 0.95, "min": 0.95}, "put_vs_raw_write": ratio,
            "variants": {"direct": variant}}
    return {"models": {"default": {"memory": {"get_vs_memcpy": ratio}, "disk": disk}}, "lookup_ms_128_chunks": 0.2}


def test_a_target_on_a_baseline_that_was_no_ceiling_is_not_met() -> None:
    """No ceiling: the tier beat the plain I/O by more than the disk's noise in the median round (a
    baseline 1.31x below the tier is no ceiling). Rounds above it are noise (a tier at the ceiling
    beats it in about half the rounds): listed, not held against it."""
    assert store_bench_report.targets(_synthetic(0.95, []))["default.disk_put"]["met"] is True
    noisy = store_bench_report.targets(_synthetic(0.97, [1, 4]))["default.disk_put"]
    assert noisy["met"] is True and noisy["ceiling_held"] is True and noisy["rounds_above"] == [2, 5]
    assert store_bench_report.target_line(noisy) == ("0.97 (min 0.97), target ≥ 0.9: met; the tier beat every "
                                                     "plain variant in round(s) [2, 5]")
    at = store_bench_report.targets(_synthetic(1.03, [0, 1, 2]))["default.disk_put"]   # at it, by noise
    assert at["met"] is True and at["ceiling_held"] is True
    above = store_bench_report.targets(_synthetic(1.31, [0, 1, 2]))["default.disk_put"]
    assert above["met"] is False and above["ceiling_held"] is False
    assert store_bench_report.target_line(above) == (
        "1.31 (min 1.31), target ≥ 0.9: MISSED (the tier beat the plain I/O by more than 5% in the median round: "
        "no ceiling); the tier beat every plain variant in round(s) [1, 2, 3]")
    low = store_bench_report.targets(_synthetic(0.85, []))["default.disk_put"]
    assert low["met"] is False                                                                    # target 0.9
    assert store_bench_report.target_line(low) == "0.85 (min 0.85), target ≥ 0.9: MISSED"


@pytest.mark.parametrize("o_direct", [False, True])
def test_plain_writes_and_reads_move_the_tiers_exact_files(tmp_path: Path, o_direct: bool) -> None:
    from kvtier.chunk import file_size
    from kvtier.tiers.disklayout import NamespaceDir
    chunk = 3 * 2**20 + 4096                                    # header + payload + trailer: not 4 KiB aligned
    fbytes = file_size(chunk)
    src = store_bench_files.random_buffer(-(-fbytes // 4096) * 4096, 5)
    names = [f"{i:02x}" + "ab" * 31 for i in range(3)]
    for shape in store_bench_raw.WRITE_SHAPES[o_direct]:
        lay = NamespaceDir(tmp_path / shape)
        assert store_bench_raw.write_files(lay, names, src, fbytes, o_direct=o_direct, shape=shape, threads=2) > 0
        files = sorted(lay.chunks.rglob("*.kvc")) if shape == "publish" else sorted(lay.tmp.iterdir())
        assert len(files) == 3 and (shape != "publish" or list(lay.tmp.iterdir()) == [])
        want = -(-fbytes // 4096) * 4096 if shape == "padded" else fbytes
        assert all(f.stat().st_size == want for f in files)
        assert all(f.read_bytes()[:fbytes] == bytes(src[:fbytes]) for f in files)
        buf = store_bench_files.aligned_buffer(-(-fbytes // 4096) * 4096)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as pool:
            for read in store_bench_raw.READ_SHAPES:
                buf[:fbytes] = bytes(fbytes)
                assert store_bench_raw.read_file(str(files[0]), buf, fbytes, o_direct=o_direct, shape=read,
                                                 pool=pool) == fbytes
                assert bytes(buf[:fbytes]) == bytes(src[:fbytes])
