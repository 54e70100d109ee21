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
    from kvtier.tiers.diskio import PIECE, PIPELINE_MIN, _groups

    PREFETCH_DEPTH = 2     # (worker_side imports vLLM; ttft passes its real PREFETCH_DEPTH)
    small, piece = tier_reads_in_flight(PIPELINE_MIN - 1, PREFETCH_DEPTH)
    assert (small, piece) == (PREFETCH_DEPTH, PIPELINE_MIN - 1)       # one read per chunk
    big = 12 << 20
    n, piece = tier_reads_in_flight(big, PREFETCH_DEPTH)
    assert piece == PIECE and n == PREFETCH_DEPTH * len(_groups(-(-big // PIECE)))


def test_bad_sizes_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        best_raw_read(tmp_path, 0, 1, 1, 4096)
