"""Worker-side loads against a real TieredStore: SSD hits are promoted into RAM only after the
load (background), corrupt chunks still become load errors, and the load's phase times are kept."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvtier.config import StoreConfig
from kvtier.transfer.page_layout import LBHNC
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.keys import chunk_keys
from kvtier.store import TieredStore
from tests.unit.test_connector_sides import BLOCK, CHUNK, NS, FakeRequest, _admit, _kv, _prompt, _saved_store, _sched, _step


def _cfg(tmp: Path, **kw) -> StoreConfig:
    data: dict = {"chunk_size": CHUNK, "memory": {"capacity": "64MiB"},
                  "disk": {"enabled": True, "path": str(tmp), "capacity": "1GiB"}}
    data.update(kw)
    return StoreConfig.model_validate(data)


def _worker(store, kv, promote="background"):
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=10, promote=promote,
                   promote_min_hits=2)
    w.register(kv)
    assert w.disabled is None
    return w


def _save_to_disk(tmp: Path, tokens, kv) -> list[int]:
    with TieredStore.open(_cfg(tmp), NS) as store:
        blocks = _saved_store(store, tokens, kv)
        assert store.flush(10)
        return blocks


def _load(store, tokens, dst, promote="background"):
    w = _worker(store, dst, promote)
    s, tables = _sched(store)
    tables.next = 7
    req = FakeRequest("b", tokens)
    assert _admit(s, tables, req) == 768
    w.load(_step(s, tables, req, 32))
    return w, tables("b")


def _assert_blocks_equal(dst, src, dst_ids, src_ids):
    for name in src:
        for d, s in zip(dst_ids, src_ids):
            assert torch.equal(dst[name][d], src[name][s])


def test_ssd_hit_is_promoted_after_the_load_not_during_it(tmp_path: Path) -> None:
    tokens = _prompt(800)
    kv = _kv(seed=11)
    src_ids = _save_to_disk(tmp_path, tokens, kv)
    keys = chunk_keys(NS, tokens)
    with TieredStore.open(_cfg(tmp_path), NS) as store:          # a new process: RAM empty
        assert store.lookup(keys).tiers == ("disk",) * 3
        dst = {k: torch.zeros_like(v) for k, v in kv.items()}
        with store.busy():                                        # hold promotion to observe the load alone
            w, ids = _load(store, tokens, dst)
            assert store.lookup(keys).tiers == ("disk",) * 3     # the load itself promoted nothing
        assert w.take_load_errors() == set()
        _assert_blocks_equal(dst, kv, ids[:6], src_ids[:6])
        t = w.last_load
        assert t is not None and t.chunks == 3 and t.nbytes == 3 * w.chunk_nbytes
        assert t.read > 0 and t.copy > 0 and t.total >= t.wait
        assert store.promoter.wait_idle(10)
        assert store.lookup(keys).tiers == ("disk",) * 3         # read once: not worth a copy (promote_min_hits=2)
        dst1 = {k: torch.zeros_like(v) for k, v in kv.items()}
        w1, ids1 = _load(store, tokens, dst1)                    # the second SSD hit
        assert w1.take_load_errors() == set()
        _assert_blocks_equal(dst1, kv, ids1[:6], src_ids[:6])
        assert store.promoter.wait_idle(10)
        assert store.lookup(keys).tiers == ("memory",) * 3       # promoted in the background afterwards
        dst2 = {k: torch.zeros_like(v) for k, v in kv.items()}
        w2, ids2 = _load(store, tokens, dst2)                    # and a later hit from RAM is exact too
        assert w2.take_load_errors() == set()
        _assert_blocks_equal(dst2, kv, ids2[:6], src_ids[:6])


def test_sync_promotion_keeps_the_old_behaviour(tmp_path: Path) -> None:
    tokens = _prompt(800)
    kv = _kv(seed=12)
    _save_to_disk(tmp_path, tokens, kv)
    with TieredStore.open(_cfg(tmp_path), NS) as store:
        with store.busy():
            _load(store, tokens, {k: torch.zeros_like(v) for k, v in kv.items()}, promote="sync")
            assert store.lookup(chunk_keys(NS, tokens)).tiers == ("memory",) * 3


def test_corrupt_chunk_file_is_a_load_error_and_never_promoted(tmp_path: Path) -> None:
    tokens = _prompt(800)
    kv = _kv(seed=13)
    src_ids = _save_to_disk(tmp_path, tokens, kv)
    keys = chunk_keys(NS, tokens)
    with TieredStore.open(_cfg(tmp_path), NS) as store:
        assert store.tier("disk") is not None
        path = store.tier("disk").path_of(keys[1])
        with open(path, "r+b") as f:                             # flip payload bytes, header intact
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xff" * 64)
        dst = {k: torch.zeros_like(v) for k, v in kv.items()}
        w, ids = _load(store, tokens, dst)
        assert w.take_load_errors() == set(ids[2:6])             # chunk 1 and everything after it
        _assert_blocks_equal(dst, kv, ids[:2], src_ids[:2])
        assert all(not dst[n][ids[2:6]].any() for n in dst)      # no unverified byte reached the KV cache
        store.promote_later(keys)                                # the same admission count as a second load
        assert store.promoter.wait_idle(10)
        assert store.tier("memory") is not None and store.tier("memory").contains(keys[0])
        assert not any(store.tier("memory").contains(k) for k in keys[1:])
