"""The ideal read (kvtier/bench/rawread.py): fresh files, the tier's reads in flight, files removed."""

from __future__ import annotations

import pytest

from kvtier.bench.rawread import best_raw_read, tier_reads_in_flight


def test_reads_every_byte_of_fresh_files_and_cleans_up(tmp_path) -> None:
    r = best_raw_read(tmp_path / "raw", file_bytes=3 * 4096 + 100, files=3, reads_in_flight=2,
                      piece_bytes=4096, tries=2)
    assert r.nbytes == 3 * (3 * 4096 + 100) and r.seconds > 0 and r.bytes_per_s > 0
    assert r.reads_in_flight == 2 and r.tries == 2 and r.piece_bytes == 4096
    assert list((tmp_path / "raw").iterdir()) == []


def test_reads_in_flight_match_the_tier() -> None:
    """As many reads in flight as the tier issues: header, pieces and tail (8 parts in 6 reads for an
    11.8 MB float32 chunk), not the file's 2 MiB pieces alone (4 reads: the old count)."""
    from kvtier.chunk import file_size
    from kvtier.tiers.diskio import PIPELINE_MIN

    PREFETCH_DEPTH = 2     # (worker_side imports vLLM; ttft passes its real PREFETCH_DEPTH)
    small, piece = tier_reads_in_flight(file_size(PIPELINE_MIN // 2), PREFETCH_DEPTH)
    assert (small, piece) == (PREFETCH_DEPTH, file_size(PIPELINE_MIN // 2))       # one read per chunk
    big = file_size(46_080 * 256)                  # SmolLM2 float32, 256-token chunk: 11.8 MB
    n, piece = tier_reads_in_flight(big, PREFETCH_DEPTH)
    assert n == PREFETCH_DEPTH * 6 and piece * 6 >= big > piece * 5


def test_reads_in_flight_are_the_reads_the_tier_issues(tmp_path, monkeypatch) -> None:
    """Counted from the tier's own preadv calls on a real chunk file."""
    import os

    from kvtier.bench.rawread import tier_reads_in_flight
    from kvtier.chunk import ChunkMeta, file_size
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers import diskio
    from kvtier.tiers.disk import DiskTier

    ns = Namespace("m", "f", "float32", "L", 16, 256)
    payload = os.urandom(46_080 * 256)
    key = chunk_keys(ns, list(range(256)))[0]
    tier = DiskTier.open(tmp_path, ns, capacity=64 << 20, o_direct=True)
    assert tier.put(ChunkMeta(key, None, 256, (len(payload),), "uint8", len(payload)), payload)
    calls = []
    real = os.preadv
    monkeypatch.setattr(diskio.os, "preadv", lambda fd, bufs, off: calls.append(off) or real(fd, bufs, off))
    import mmap
    out = memoryview(mmap.mmap(-1, len(payload)))      # page-aligned, as the connector's buffers
    assert tier.get_into(key, out) is not None and bytes(out) == payload
    tier.close()
    assert tier_reads_in_flight(file_size(len(payload)), 1)[0] == len(set(calls))


def test_bad_sizes_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        best_raw_read(tmp_path, 0, 1, 1, 4096)
