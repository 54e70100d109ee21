"""The connector's worker half keeps the ordering rules of ``kvtier.transfer.streams`` on a device.

The worker runs with a recording ``Streams`` (``recording_streams.py``): events complete only when the
host waits for them or the test says the device caught up, and every stream operation and block copy
is logged. Each rule is checked on the log; each check is also shown to catch the bug it is for, by
running the same scenario with one ordering call broken.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.integrations.vllm.async_loads import DoneLoad
from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, LoadChunk, LoadPlan, SaveChunk
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.tiers.protocol import ReadResult, Status
from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.host_buffers import HostBuffer
from kvtier.transfer.page_layout import LBHNC
from tests.unit.recording_streams import (
    RecordingStreams,
    attention_after_its_layer,
    copies_after_compute,
    record_copies,
)

BLOCK, CHUNK, LAYERS, HEADS, HEAD, NUM_BLOCKS = 16, 32, 3, 2, 8, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class OrderStore:
    """A dict store whose every write into a host buffer checks that no copy still uses the buffer."""

    def __init__(self, buffers: list[HostBuffer]):
        self.data: dict[bytes, bytes] = {}
        self.buffers = buffers
        self.violations: list[str] = []

    def _check(self, key: bytes, view: memoryview, what: str) -> None:
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        for buf in self.buffers:
            if buf.tensor.data_ptr() == addr and not buf.event.query():
                self.violations.append(f"host buffer {what} {key!r} before its last copy completed")

    def _write(self, key: bytes, out: memoryview) -> int | None:
        self._check(key, out, "rewritten with")
        data = self.data.get(key)
        if data is None:
            return None
        out[:len(data)] = data
        return len(data)

    def get_into(self, key, out, *, promote=None, deadline=None, local_only=False):
        return self._write(key, out)

    def read_into(self, keys, outs, deadline=None, *, promote=None, local_only=False, lent=False):
        res = []
        for k, o in zip(keys, outs):
            n = self._write(k, o)
            res.append(ReadResult(Status.HIT, SimpleNamespace(payload_len=n)) if n else ReadResult(Status.MISS))
        return res

    def put(self, key, parent, payload, *, num_tokens, shape, dtype):
        self._check(key, payload, "read as")
        self.data[key] = bytes(payload)
        return True

    def where(self, key):
        return "memory" if key in self.data else None

    def busy(self):
        import contextlib
        return contextlib.nullcontext()

    def promote(self, meta, payload): ...
    def promote_later(self, keys, min_hits=1): return 0
    def prepare_memory(self, n): return False
    def start_background_threads(self): ...
    def subscribe(self, listener): return lambda: None
    def has_remote(self): return False


def _kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g)
    return {n: base[i] for i, n in enumerate(NAMES)}


@pytest.fixture
def rig(monkeypatch):
    rec = RecordingStreams()
    buffers: list[HostBuffer] = []
    new_buffer = BlockCopier.new_buffer

    def tracked(self):
        buf = new_buffer(self)
        buffers.append(buf)
        return buf

    monkeypatch.setattr(BlockCopier, "new_buffer", tracked)
    record_copies(monkeypatch, rec)
    store = OrderStore(buffers)

    def worker(kv, **kw) -> WorkerSide:
        w = WorkerSide(store, LBHNC, chunk_size=CHUNK, block_size=BLOCK, load_timeout_s=5.0,
                       background_cpus="inherit", streams=rec, **kw)
        w.register(kv)
        assert w.disabled is None
        return w

    return SimpleNamespace(rec=rec, store=store, worker=worker)


def _chunks(n: int, first_block: int) -> tuple[LoadChunk, ...]:
    return tuple(LoadChunk(bytes([i]) * 16, (first_block + 2 * i, first_block + 2 * i + 1)) for i in range(n))


def _fill(store: OrderStore, src: dict[str, torch.Tensor], n: int) -> None:
    """Chunk i holds src's blocks 2i, 2i+1 of every layer."""
    for i in range(n):
        pages = torch.stack([src[name][2 * i:2 * i + 2] for name in NAMES])
        store.data[bytes([i]) * 16] = pages.contiguous().view(torch.uint8).numpy().tobytes()


def _assert_loaded(src, dst, n: int, first_block: int) -> None:
    for name in NAMES:
        for b in range(2 * n):
            assert torch.equal(dst[name][first_block + b], src[name][b])


# -- the scenarios: the engine's side of one step each; each returns the rule violations --------
def save_scenario(rig) -> list[str]:
    src = _kv(1)
    w = rig.worker(src)
    rig.rec.compute("forward")                      # the forward pass writes the blocks
    saves = [SaveChunk("r", i, bytes([i]) * 16, None, (2 * i, 2 * i + 1)) for i in range(4)]
    w.save(KvtierConnectorMetadata(saves=saves))
    assert set(rig.store.data) == {bytes([i]) * 16 for i in range(4)}
    return copies_after_compute(rig.rec.log, "gather", "forward") + rig.store.violations


def sync_load_scenario(rig) -> list[str]:
    src, dst = _kv(1), _kv(2)
    _fill(rig.store, src, 5)                        # more chunks than the ring's buffers
    w = rig.worker(dst)
    rig.rec.compute("zero")                          # vLLM zeroes the new blocks on the compute stream
    w.load(KvtierConnectorMetadata(loads=[LoadPlan("r", 0, 5 * CHUNK, _chunks(5, 16))]))
    for layer in range(LAYERS):
        rig.rec.compute("attention", layer)
    assert w.take_load_errors() == set()
    _assert_loaded(src, dst, 5, 16)
    return (copies_after_compute(rig.rec.log, "scatter", "zero") + attention_after_its_layer(rig.rec.log)
            + rig.store.violations)


def layerwise_scenario(rig) -> list[str]:
    src, dst = _kv(1), _kv(2)
    _fill(rig.store, src, 5)
    w = rig.worker(dst, layerwise=True)
    for step, first in enumerate((16, 6)):          # the second step reuses the first step's buffers
        rig.rec.compute("zero")
        w.load(KvtierConnectorMetadata(loads=[LoadPlan(f"r{step}", 0, 5 * CHUNK, _chunks(5, first))]))
        for layer, name in enumerate(NAMES):
            w.wait_layer(name)
            rig.rec.compute("attention", layer)
        w.finish_layers()
        assert w.take_load_errors() == set()
        _assert_loaded(src, dst, 5, first)
    return (copies_after_compute(rig.rec.log, "scatter", "zero") + attention_after_its_layer(rig.rec.log)
            + rig.store.violations)


def async_scenario(rig) -> list[str]:
    src, dst = _kv(1), _kv(2)
    _fill(rig.store, src, 5)
    w = rig.worker(dst)
    rig.rec.compute("zero")
    w.load(KvtierConnectorMetadata(loads=[LoadPlan("r", 0, 5 * CHUNK, _chunks(5, 16), async_load=True)]))
    end = time.monotonic() + 10
    while not w._async._done and time.monotonic() < end:       # the loader thread issued every copy
        time.sleep(0.01)
    bad = []
    if w.get_finished(set()):
        bad.append("a background load was reported finished before its copies completed")
    rig.rec.complete_all()                                      # the device caught up
    assert w.get_finished(set()) == ({"r"} if not bad else set())
    _assert_loaded(src, dst, 5, 16)
    return bad + copies_after_compute(rig.rec.log, "scatter", "zero") + rig.store.violations


SCENARIOS = {"save": save_scenario, "sync load": sync_load_scenario, "layerwise load": layerwise_scenario,
             "async load": async_scenario}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ordering_rules_hold(rig, name):
    assert SCENARIOS[name](rig) == []


def _no_follow(mp):
    mp.setattr(BlockCopier, "follow", lambda self, event: None)


def _no_fence(mp):
    mp.setattr(BlockCopier, "fence", lambda self, event: None)


def _report_early(mp):
    mp.setattr(DoneLoad, "landed", lambda self: True)


def _no_claim(mp):
    mp.setattr(HostBuffer, "claim", lambda self: self)


BROKEN = [  # (scenario, the ordering call removed, what its check must report)
    ("save", _no_follow, "gather of blocks"),                      # rule 1
    ("sync load", _no_follow, "scatter of blocks"),                # rule 2
    ("layerwise load", _no_follow, "scatter of blocks"),
    ("async load", _no_follow, "scatter of blocks"),
    ("sync load", _no_fence, "attention on layer"),                # rule 3
    ("layerwise load", _no_fence, "attention on layer"),
    ("async load", _report_early, "reported finished before"),     # rule 4
    ("sync load", _no_claim, "host buffer rewritten"),             # rule 5
    ("layerwise load", _no_claim, "host buffer rewritten"),
    ("async load", _no_claim, "host buffer rewritten"),
    ("save", _no_claim, "host buffer read as"),
]


@pytest.mark.parametrize("name,breakage,expected", BROKEN, ids=lambda x: getattr(x, "__name__", x))
def test_each_check_catches_its_broken_variant(rig, monkeypatch, name, breakage, expected):
    breakage(monkeypatch)
    try:
        violations = SCENARIOS[name](rig)
    except AssertionError as e:       # a broken ordering may also corrupt what the scenario checks
        violations = [str(e)]
    assert any(expected in v for v in violations), violations
