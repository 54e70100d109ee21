"""`kvtier bench store --shared`: the rows run end to end on throwaway local servers (tiny volume)."""

from __future__ import annotations

import pytest

from kvtier.bench.store_bench_shared import run_shared, shared_markdown

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_shared_rows_for_both_backends():
    r = run_shared(["valkey", "mooncake"], chunk=256 * 1024, volume=4 * 2**20, repeat=1, batch=4, log=lambda *_: None)
    for b in ("valkey", "mooncake"):
        for k in ("get_gbps", "put_gbps", "raw_get_gbps", "raw_put_gbps", "exists_per_s_256_chunks"):
            assert r[f"{b}.{k}"] > 0
        assert r[b]["exists"]["lookup_ms_256_chunks"] > 0
    md = "\n".join(shared_markdown({"shared": {b: r[b] for b in ("valkey", "mooncake")}}))
    assert "| valkey |" in md and "| mooncake |" in md
