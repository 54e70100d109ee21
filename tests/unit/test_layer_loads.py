"""Layer-pipelined loads: per-layer scheduling, waits, deadlines and errors (fake reads, no vLLM)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations.vllm.layer_loads import LayerLoader
from kvtier.transfer.page_layout import LBHNC
from kvtier.integrations.vllm.metadata import LoadChunk, LoadPlan
from kvtier.integrations.vllm.sync_loads import SyncLoader
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.keys import chunk_keys
from tests.unit.test_connector_sides import BLOCK as WBLOCK
from tests.unit.test_connector_sides import CHUNK, NS, FakeRequest, FakeStore, _admit, _kv, _prompt, _sched, _step

BPC, BLOCK, LAYERS = 2, 4, 5


class Reads:
    """Chunk reads from a dict: buffer = [key]; ``fail`` keys miss; ``gate`` keys block until released."""

    def __init__(self, fail=(), gate=()):
        self.fail, self.gate = set(fail), set(gate)
        self.release = threading.Event()

    def __call__(self, key, buf):
        if key in self.gate:
            self.release.wait(30)
        if key in self.fail:
            return False, "miss"
        buf[0] = key
        return True, None


class Blocks:
    """vLLM's blocks per layer: (layer, block id) -> key copied there, and the order of copies."""

    def __init__(self):
        self.cells: dict[tuple[int, int], bytes] = {}
        self.order: list[int] = []
        self.lock = threading.Lock()

    def layer(self, layer, block_ids, first_block, buf):
        with self.lock:
            self.order.append(layer)
            for b in block_ids:
                self.cells[(layer, b)] = buf[0]

    def whole(self, block_ids, first_block, buf):
        for layer in range(LAYERS):
            self.layer(layer, block_ids, first_block, buf)


def _plans(sizes):
    nxt, plans = 0, []
    for p, n in enumerate(sizes):
        chunks = []
        for i in range(n):
            chunks.append(LoadChunk(f"k{p}.{i}".encode(), (nxt, nxt + 1)))
            nxt += 2
        plans.append(LoadPlan(f"r{p}", 0, n * BPC * BLOCK, tuple(chunks)))
    return plans


def _loader(reads, blocks):
    return LayerLoader(reads, blocks.layer, lambda: [None], num_layers=LAYERS, chunk_nbytes=80,
                       blocks_per_chunk=BPC, block_size=BLOCK)


def _wait_all(loader):
    for layer in range(LAYERS):
        loader.wait_layer(layer)


def test_each_wait_returns_with_its_layer_in_place_and_copies_go_in_layer_order():
    plans = _plans([3, 2])
    blocks = Blocks()
    loader = _loader(Reads(), blocks)
    loader.start(plans, time.monotonic() + 10)
    for layer in range(LAYERS):
        loader.wait_layer(layer)
        with blocks.lock:
            for plan in plans:
                for ch in plan.chunks:
                    assert all(blocks.cells[(layer, b)] == ch.key for b in ch.block_ids)
    res = loader.finish()
    assert blocks.order == sorted(blocks.order)
    assert res.error_blocks == set() and not res.failed_reqs and not loader.unwaited
    assert [o.loaded_tokens for o in res.outcomes] == [3 * BPC * BLOCK, 2 * BPC * BLOCK]
    assert len(res.loaded) == 5 and loader.finish() is None


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=4), data=st.data())
def test_same_outcome_as_the_whole_request_path(sizes, data):
    plans = _plans(sizes)
    keys = [ch.key for p in plans for ch in p.chunks]
    fail = data.draw(st.sets(st.sampled_from(keys))) if keys else set()
    whole_blocks, layer_blocks = Blocks(), Blocks()
    whole = SyncLoader(Reads(fail), whole_blocks.whole, lambda: [None], chunk_nbytes=80, blocks_per_chunk=BPC,
                       block_size=BLOCK).run(plans, time.monotonic() + 10)
    loader = _loader(Reads(fail), layer_blocks)
    loader.start(plans, time.monotonic() + 10)
    _wait_all(loader)
    res = loader.finish()
    assert res.error_blocks == whole.error_blocks
    assert res.failed_reqs == whole.failed_reqs
    assert sorted(res.loaded) == sorted(whole.loaded)
    assert sorted(res.missing) == sorted(whole.missing)
    assert [(o.loaded_tokens, o.failed_tokens, o.error) for o in res.outcomes] == \
        [(o.loaded_tokens, o.failed_tokens, o.error) for o in whole.outcomes]
    assert res.nbytes == whole.nbytes
    assert layer_blocks.cells == whole_blocks.cells      # same blocks written, with the same chunks
    failed = res.error_blocks
    assert not any(b in failed for (_, b) in layer_blocks.cells)   # a failed block is never written


def test_a_read_past_the_deadline_abandons_the_run_and_nothing_is_written_after():
    plans = _plans([2, 1])
    reads = Reads(gate={b"k0.1"})
    blocks = Blocks()
    loader = _loader(reads, blocks)
    loader.start(plans, time.monotonic() + 0.3)
    t0 = time.monotonic()
    loader.wait_layer(0)                  # bounded by the deadline, never a hang
    assert time.monotonic() - t0 < 5
    _wait_all(loader)                     # later waits return at once
    res = loader.finish()
    written = dict(blocks.cells)
    reads.release.set()
    time.sleep(0.3)                       # the late read lands: it must not reach vLLM's blocks
    assert blocks.cells == written
    assert res.failed_reqs == {"r0", "r1"}
    assert res.error_blocks == {b for p in plans for ch in p.chunks for b in ch.block_ids}
    assert {o.error for o in res.outcomes} == {"timeout"}
    assert all(o.loaded_tokens == 0 for o in res.outcomes)
    assert loader.buffers == []           # dropped: a late read may still write into them


def test_layers_vllm_never_waited_for_fail_the_step():
    plans = _plans([2])
    loader = _loader(Reads(), Blocks())
    loader.start(plans, time.monotonic() + 10)
    loader.wait_layer(0)                  # an attention backend that does not call the connector per layer
    res = loader.finish()
    assert loader.unwaited
    assert res.failed_reqs == {"r0"} and res.outcomes[0].error == "unwaited"
    assert res.error_blocks == {0, 1, 2, 3} and res.outcomes[0].loaded_tokens == 0


def test_disabled_run_fails_every_plan_without_reading():
    plans = _plans([1, 2])
    reads = Reads(gate={b"k0.0"})         # a read would block: none may happen
    loader = _loader(reads, Blocks())
    loader.start(plans, time.monotonic() + 10, disabled=True)
    _wait_all(loader)
    res = loader.finish()
    assert res.failed_reqs == {"r0", "r1"} and {o.error for o in res.outcomes} == {"disabled"}


def test_a_broken_copy_fails_the_step_and_releases_every_wait():
    def broken(layer, block_ids, first_block, buf):
        if layer == 2:
            raise RuntimeError("copy failed")

    plans = _plans([2])
    loader = LayerLoader(Reads(), broken, lambda: [None], num_layers=LAYERS, chunk_nbytes=80,
                         blocks_per_chunk=BPC, block_size=BLOCK)
    loader.start(plans, time.monotonic() + 10)
    _wait_all(loader)
    res = loader.finish()
    assert res.failed_reqs == {"r0"} and res.outcomes[0].error == "copy"
    assert res.error_blocks == {0, 1, 2, 3}


# -- the worker with load_mode layerwise (fake store, CPU tensors) ---------------------------

@pytest.mark.parametrize("fail_chunk", [None, 1])
def test_worker_layerwise_load_is_exact_and_failures_are_reported(fail_chunk):
    store = FakeStore()
    tokens = _prompt(1100)
    src = _kv(seed=5)
    s, tables = _sched(store)
    req = FakeRequest("a", tokens)
    _admit(s, tables, req)
    w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=WBLOCK, load_timeout_s=5.0)
    w.register(src)
    w.save(_step(s, tables, req, 1100))
    w.end_step()
    if fail_chunk is not None:
        store.fail_gets.add(chunk_keys(NS, tokens)[fail_chunk])
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2 = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=WBLOCK, load_timeout_s=5.0, layerwise=True)
    w2.register(dst)
    s2, tables2 = _sched(store)
    req2 = FakeRequest("b", tokens)
    assert _admit(s2, tables2, req2) == 1024
    meta = _step(s2, tables2, req2, 76)
    n_puts = len(store.puts)
    w2.load(meta)                                   # returns at once: the forward pass waits per layer
    for name in sorted(dst):
        w2.wait_layer(name)
    w2.finish_layers()
    errors = w2.take_load_errors()
    good = 8 if fail_chunk is None else 2 * fail_chunk
    assert errors == set(tables2("b")[good:8])
    for name in src:
        for i in range(good):
            assert torch.equal(dst[name][tables2("b")[i]], src[name][tables("a")[i]])
        for i in range(good, 8):                    # never written: vLLM recomputes them
            assert not dst[name][tables2("b")[i]].any()
    w2.save(meta)
    if fail_chunk is not None:
        assert len(store.puts) == n_puts            # nothing saved for a request whose load failed
    out = w2.take_worker_meta().loads["b"]
    assert out.loaded_tokens == good * WBLOCK
