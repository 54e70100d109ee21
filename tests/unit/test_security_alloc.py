"""Bounded reads: no reader of any tier allocates more than the sizes it checked against the file /
value size AND the configured read limit (``store.max_chunk_bytes``), whatever a hostile writer
planted: huge sparse files, headers that claim huge payloads, values far past the limit.

Allocations are measured, not assumed: ``tracemalloc`` (every bytearray / bytes a reader makes) plus
spies on the thread-local bounce buffers (mmap, invisible to tracemalloc) of the disk and the
shared-filesystem readers, and on the byte ranges the Valkey reader asks its client for.
"""

from __future__ import annotations

import os
import tracemalloc
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import chunk
from kvtier.chunk import HEADER_SIZE, TRAILER_SIZE, ChunkMeta, encode, encode_header, file_size
from kvtier.config import SharedFsConfig, StoreConfig, ValkeyConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.store import TieredStore
from kvtier.tiers import diskio
from kvtier.tiers.sharedfs import io as sio
from kvtier.tiers.protocol import Deadline, Status

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 6000                      # a real chunk's payload
LIMIT = 2**20                 # store.max_chunk_bytes in these tests
SLACK = 64 * 1024             # interpreter noise tracemalloc sees besides the reader's buffers (threads...)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SIZES = st.one_of(st.integers(0, HEADER_SIZE + P + 100), st.integers(LIMIT - 64, LIMIT + 64),
                  st.integers(LIMIT, 2**40))   # up to 1 TiB (sparse files: no disk used)
CLAIMS = st.one_of(st.none(), st.integers(0, 2**63 - 1), st.just(P))   # header payload_len (None: file's own)


@pytest.fixture(autouse=True)
def _reset_limits():
    yield
    chunk._read_limits.clear()


def _payload() -> bytes:
    return np.random.default_rng(0).integers(0, 256, P, dtype=np.uint8).tobytes()


def _meta(plen: int) -> ChunkMeta:
    return ChunkMeta(chunk_keys(NS, [1, 2, 3, 4])[0], None, 4, (plen,), "uint8", plen)


def _plant(path: Path, size: int, claim: int | None) -> None:
    """A file of ``size`` bytes (sparse) whose header claims ``claim`` payload bytes for our key."""
    plen = max(0, size - HEADER_SIZE - TRAILER_SIZE) if claim is None else claim
    with open(path, "wb") as fh:
        if size >= HEADER_SIZE:
            fh.write(encode_header(NS.digest(), _meta(plen)))
        fh.truncate(size)


class _Spy:
    """Largest size requested from the readers' bounce buffers, and tracemalloc's peak."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bounce = 0
        for mod, name in ((diskio, "_bounce"), (sio, "bounce")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._wrap(real))

    def _wrap(self, real: Callable[[int], memoryview]) -> Callable[[int], memoryview]:
        def spy(size: int) -> memoryview:
            self.bounce = max(self.bounce, size)
            return real(size)
        return spy

    @staticmethod
    def peak(fn: Callable[[], Any]) -> tuple[Any, int]:
        """``fn()`` and the most bytes allocated (and not yet freed) at any moment during it."""
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            out = fn()
            return out, tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()


def _assert_bounded(spy: _Spy, peak: int, bound: int) -> None:
    assert spy.bounce <= bound + 4096, f"bounce buffer of {spy.bounce} B > bound {bound} B"
    assert peak <= bound + SLACK, f"allocated {peak} B > bound {bound} B"


@FUZZ
@given(size=SIZES, claim=CLAIMS)
def test_disk_tier_readers_allocate_within_the_read_limit(tmp_path, monkeypatch, size, claim):
    cfg = StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False}, "max_chunk_bytes": LIMIT,
                                      "disk": {"enabled": True, "path": str(tmp_path / uuid.uuid4().hex),
                                               "capacity": 10**8}})
    with TieredStore.open(cfg, NS) as s:
        key = chunk_keys(NS, [1, 2, 3, 4])[0]
        assert s.put(key, None, _payload(), num_tokens=4, shape=(P,), dtype="uint8") and s.flush(10)
        path = Path(s.disk.path_of(key))
        _plant(path, size, claim)
        spy = _Spy(monkeypatch)
        got, peak = spy.peak(lambda: s.get(key))                  # allocates by file size: must check it
        assert got is None
        _assert_bounded(spy, peak, LIMIT)
        if path.exists():
            _plant(path, size, claim)                             # a rejected file may have been removed
        out = bytearray(P)

        def get_into() -> int | None:
            try:
                return s.get_into(key, out)
            except ValueError:      # the local tier's contract: a well-formed chunk larger than the buffer
                return None

        n, peak = spy.peak(get_into)                              # the caller's buffer bounds it
        assert n is None
        _assert_bounded(spy, peak, file_size(P))
        if size > LIMIT:
            assert s.stats()["counters"].get("events.too_large", 0) >= 1


@FUZZ
@given(size=SIZES, claim=CLAIMS)
def test_sharedfs_tier_readers_allocate_within_the_read_limit(tmp_path, monkeypatch, size, claim):
    from kvtier.tiers.sharedfs import SharedFsTier

    chunk.register_read_limit(NS.digest(), LIMIT)
    mnt = tmp_path / uuid.uuid4().hex
    mnt.mkdir()
    tm = Telemetry()
    tier = SharedFsTier.open(SharedFsConfig(path=mnt, janitor=False), NS, tm)
    try:
        key = _meta(P).key
        path = Path(tier.layout.path_of(key))
        path.parent.mkdir(parents=True, exist_ok=True)
        spy = _Spy(monkeypatch)
        _plant(path, size, claim)
        (res,), peak = spy.peak(lambda: tier.read_into([key], [memoryview(bytearray(P))], Deadline.after(10)))
        assert res.status is not Status.HIT
        _assert_bounded(spy, peak, file_size(P) + P)              # + the caller's own buffer, made inside
        _plant(path, size, claim)
        got, peak = spy.peak(lambda: tier.get(key))
        assert got is None
        _assert_bounded(spy, peak, LIMIT)
    finally:
        tier.close()


# -- Valkey: a fake client holds values of any (virtual) length; the reader's GETRANGE bounds the bytes
class _Pipe:
    def __init__(self, srv: "_FakeValkey") -> None:
        self.srv, self.ops = srv, []

    def getrange(self, key: bytes, start: int, end: int) -> None:
        self.ops.append((key, start, end))

    def get(self, key: bytes) -> None:   # a whole value, whatever its length (what a bounded reader avoids)
        self.ops.append((key, 0, -1))

    def delete(self, key: bytes) -> None:
        self.ops.append((key, None, None))

    def execute(self, raise_on_error: bool = True) -> list:
        return [self.srv.getrange(k, s, e) if s is not None else self.srv.values.pop(k, None) is not None
                for k, s, e in self.ops]


class _FakeValkey:
    """Values are (prefix bytes, total length): bytes past the prefix are zeros, made only on demand."""

    def __init__(self) -> None:
        self.values: dict[bytes, tuple[bytes, int]] = {}
        self.largest_request = 0

    def pipeline(self, transaction: bool = False) -> _Pipe:
        return _Pipe(self)

    def get(self, key: bytes) -> bytes | None:
        return self.getrange(key, 0, -1) if key in self.values else None

    def getrange(self, key: bytes, start: int, end: int) -> bytes:
        if key not in self.values:
            return b""
        head, total = self.values[key]
        end = total - 1 if end < 0 else end
        self.largest_request = max(self.largest_request, min(end + 1, total) - start)
        n = min(end + 1, total) - start
        return head[start:start + n] + bytes(max(0, n - len(head[start:])))


class _FakeConns:
    def __init__(self, client: _FakeValkey) -> None:
        from kvtier.tiers.valkey.conn import Group

        self._group = Group
        self.client = client

    def groups(self, which: str, keys) -> list:
        return [self._group(self.client, list(range(len(keys))), "fake")]

    def node_failed(self) -> None:
        pass


@FUZZ
@given(size=SIZES, claim=CLAIMS, valid=st.booleans())
def test_valkey_reader_never_asks_for_more_than_the_limit(size, claim, valid):
    from kvtier.tiers.valkey import ValkeyTier

    chunk.register_read_limit(NS.digest(), LIMIT)
    srv, tm = _FakeValkey(), Telemetry()
    tier = ValkeyTier(ValkeyConfig(url="redis://127.0.0.1:1/0"), NS, tm, _FakeConns(srv))
    meta = _meta(P)
    good = encode(NS.digest(), meta, _payload())
    if valid:
        srv.values[tier._rk(meta.key)] = (good, len(good))
    else:
        plen = max(0, size - HEADER_SIZE - TRAILER_SIZE) if claim is None else claim
        srv.values[tier._rk(meta.key)] = (bytes(encode_header(NS.digest(), _meta(plen))), size)
    out = bytearray(P)
    (res,), peak = _Spy.peak(lambda: tier.read_into([meta.key], [memoryview(out)], Deadline.after(10)))
    assert srv.largest_request <= file_size(P) + 1, f"read {srv.largest_request} B of a value"
    assert peak <= file_size(P) + SLACK
    assert (res.status is Status.HIT) == valid and (not valid or bytes(out) == _payload())
    srv.largest_request = 0
    got, peak = _Spy.peak(lambda: tier.get(meta.key))
    assert srv.largest_request <= LIMIT + 1 and peak <= 2 * LIMIT + SLACK   # the value + the returned copy
    assert (got is not None) == valid


class _FakeMooncake:
    def __init__(self, size: int) -> None:
        self.size = size
        self.removed: list[str] = []

    def get_size(self, name: str) -> int:
        return self.size

    def remove(self, name: str, force: bool = False) -> int:
        self.removed.append(name)
        return 0

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        return [-704] * len(names)   # nothing to read (the size check comes first)


@pytest.mark.parametrize("size", [LIMIT + 1, 2**40])
def test_mooncake_get_checks_the_object_size_before_allocating(size):
    from kvtier.config import MooncakeConfig
    from kvtier.tiers.mooncake import MooncakeTier
    from kvtier.tiers.mooncake.client import Client

    chunk.register_read_limit(NS.digest(), LIMIT)
    client = Client(MooncakeConfig())
    client.store = _FakeMooncake(size)
    tm = Telemetry()
    tier = MooncakeTier(MooncakeConfig(), NS, tm, client)
    try:
        got, peak = _Spy.peak(lambda: tier.get(_meta(P).key))
        assert got is None and peak <= SLACK
        assert tm.counts["events.too_large"] == 1 and client.store.removed
    finally:
        tier._lookups.shutdown(wait=False)


def test_read_limit_default_and_config():
    assert StoreConfig().read_limit() == 256 * 2**20 + 8192
    assert StoreConfig(chunk_size=16).read_limit() == 64 * 2**20 + 8192
    assert StoreConfig(max_chunk_bytes="1MiB").read_limit() == 2**20
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        StoreConfig(max_chunk_bytes=100)
    assert chunk.read_limit(os.urandom(32)) == chunk.DEFAULT_MAX_CHUNK_BYTES
