"""Shared-tier encodings (kvtier.encoding, kvtier.tiers.encoded): exact lossless round trips, the
int8 error bound per channel, one namespace per encoding, corrupted frames as counted misses, and a
store whose shared tier (sharedfs on a plain directory) holds encoded chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import encoding as enc
from kvtier.chunk import ChunkMeta, file_size
from kvtier.config import SharedFsConfig, StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.store import TieredStore
from kvtier.tiers.encoded import EncodedTier, encoded_namespace
from kvtier.tiers.protocol import Deadline, Status
from kvtier.tiers.sharedfs import SharedFsTier

pytest.importorskip("zstandard")

NS = Namespace("m", "f", "float32", "lbhnc", 4, 8)
SHAPE = (3, 2, 2, 4, 16)                 # [layers, blocks, kv_heads, block tokens, 2*head_size]


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_to_f32(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def _kv(shape: tuple[int, ...], dtype: str, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    # channels with very different ranges, as real K has (a few outlier channels)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 20, size=shape[-1]).astype(np.float32)
    return x.tobytes() if dtype == "float32" else _bf16(x).tobytes()


def _decode(name: str, frame, n: int, shape, dtype: str) -> bytes:
    out = memoryview(bytearray(n))
    assert enc.decode_into(name, frame, out, shape, dtype) == n
    return bytes(out)


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=5).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["random", "zeros", "smooth"]))
def test_zstd_round_trip_is_exact(shape, dtype, seed, kind) -> None:
    itemsize = 4 if dtype == "float32" else 2
    n = int(np.prod(shape)) * itemsize
    if kind == "random":
        payload = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    elif kind == "zeros":
        payload = bytes(n)
    else:
        payload = _kv(shape, dtype, seed)
    frame = enc.encode("zstd", payload, shape, dtype)
    assert len(frame) <= n + enc.MAX_OVERHEAD           # never much larger than plain
    assert _decode("zstd", frame, n, shape, dtype) == payload
    assert enc.encode("plain", payload, shape, dtype) == payload


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 64), st.integers(1, 32)),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
def test_int8_error_is_within_half_a_step_per_channel(shape, dtype, seed) -> None:
    payload = _kv(shape, dtype, seed)
    frame = enc.encode("int8", payload, shape, dtype)
    got = _decode("int8", frame, len(payload), shape, dtype)
    if dtype == "float32":
        x, y = (np.frombuffer(b, np.float32).reshape(shape) for b in (payload, got))
    else:
        x, y = (_bf16_to_f32(np.frombuffer(b, np.uint16)).reshape(shape) for b in (payload, got))
    g = x.reshape(-1, shape[-2], shape[-1])
    step = np.abs(g).max(axis=1, keepdims=True) / 127          # one scale per (group, channel)
    err = np.abs(y.reshape(g.shape) - g)
    bound = step / 2 * (1 + 1e-5) + (np.abs(g) + step) * (2.0 ** -8 if dtype == "bfloat16" else 1e-6)
    assert (err <= bound).all()
    plain = len(payload)
    assert len(frame) < plain * (0.3 if dtype == "float32" else 0.55) + enc.MAX_OVERHEAD + 4 * g.shape[0] * shape[-1]


def test_int8_keeps_what_it_cannot_carry_exact() -> None:
    x = np.ones((2, 4, 8), np.float32)
    x[0, 1, 2] = np.inf
    for payload, shape, dtype in [(x.tobytes(), x.shape, "float32"), (b"\x01" * 64, (64,), "uint8")]:
        frame = enc.encode("int8", payload, shape, dtype)
        assert _decode("int8", frame, len(payload), shape, dtype) == payload


@pytest.mark.parametrize("name", ["zstd", "int8"])
def test_bad_frames_are_encoding_errors(name: str) -> None:
    payload = _kv((2, 8, 16), "float32")
    frame = bytearray(enc.encode(name, payload, (2, 8, 16), "float32"))
    out = memoryview(bytearray(len(payload)))
    for bad in (frame[:10], b"XXXX" + frame[4:], frame[:-1]):
        with pytest.raises(enc.EncodingError):
            enc.decode_into(name, bytes(bad), out, (2, 8, 16), "float32")
    other = "int8" if name == "zstd" else "zstd"
    with pytest.raises(enc.EncodingError):                     # never decoded as another codec
        enc.decode_into(other, bytes(frame), out, (2, 8, 16), "float32")
    with pytest.raises(ValueError):                             # a caller's buffer too small
        enc.decode_into(name, bytes(frame), memoryview(bytearray(8)), (2, 8, 16), "float32")


def test_namespace_names_the_encoding() -> None:
    ids = {e: NS.with_encoding(e) for e in enc.ENCODINGS}
    assert ids["plain"] is NS and len({n.digest() for n in ids.values()}) == 3
    assert len({n.short_id() for n in ids.values()}) == 3
    assert b"encoding" not in NS.canonical_bytes()             # plain namespaces keep their digests
    with pytest.raises(ValueError):
        enc.check_encoding("gzip")
    with pytest.raises(ValueError):
        SharedFsConfig(path="/x", encoding="gzip")


# -- through the shared tier ------------------------------------------------------------------------
def _tier(path: Path, encoding: str, tm: Telemetry) -> EncodedTier | SharedFsTier:
    cfg = SharedFsConfig(path=path, janitor=False, encoding=encoding)
    if encoding == "plain":
        return SharedFsTier.open(cfg, NS, tm)
    return EncodedTier.wrap(SharedFsTier.open(cfg, encoded_namespace(NS, encoding), tm), encoding, tm)


def _chunks(n: int, dtype: str = "float32") -> list[tuple[ChunkMeta, bytes]]:
    keys = chunk_keys(NS, list(range(8 * n)))
    out = []
    for i, k in enumerate(keys):
        p = _kv(SHAPE, dtype, seed=i)
        out.append((ChunkMeta(k, keys[i - 1] if i else None, 8, SHAPE, dtype, len(p)), p))
    return out


def _write(tier, chunks) -> None:
    for m, p in chunks:
        assert tier.put(m, p)
    assert tier.flush(30)


def _read(tier, chunks):
    outs = [memoryview(bytearray(m.payload_len)) for m, _ in chunks]
    return tier.read_into([m.key for m, _ in chunks], outs, Deadline.after(10)), outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_encoded_tier_round_trip_and_size(tmp_path: Path, dtype: str) -> None:
    chunks = _chunks(3, dtype)
    tm = Telemetry()
    for name in ("zstd", "int8"):
        tier = _tier(tmp_path, name, tm)
        _write(tier, chunks)
        res, outs = _read(tier, chunks)
        assert [r.status for r in res] == [Status.HIT] * 3
        for (m, p), r, o in zip(chunks, res, outs):
            assert r.meta == m                                   # the plain chunk's meta
            if name == "zstd":
                assert bytes(o) == p
        got = tier.get(chunks[0][0].key)
        assert got is not None and got[0] == chunks[0][0] and len(got[1]) == len(chunks[0][1])
        tier.close()
    frames = {d.name: sum(f.stat().st_size - file_size(0) for f in d.rglob("*.kvc"))
              for d in tmp_path.iterdir() if d.is_dir()}
    assert len(frames) == 2                                      # one directory per encoding
    size = {name: frames[NS.with_encoding(name).short_id()] for name in ("zstd", "int8")}
    g, t, c = 3 * 2 * 2, SHAPE[-2], SHAPE[-1]
    # int8: one byte per element + a float32 scale per (group, channel) over its t tokens + the frame header
    assert size["int8"] == 3 * (enc.MAX_OVERHEAD + 4 * g * c + g * t * c)
    assert size["zstd"] < 3 * len(chunks[0][1])
    if dtype == "float32":                                       # with only t = 4 tokens per scale, bf16 does not shrink
        assert size["int8"] < 0.6 * 3 * len(chunks[0][1])


def test_reader_with_another_encoding_sees_a_miss(tmp_path: Path) -> None:
    chunks = _chunks(2)
    tm = Telemetry()
    writer = _tier(tmp_path, "int8", tm)
    _write(writer, chunks)
    writer.close()
    for name in ("plain", "zstd"):
        reader = _tier(tmp_path, name, tm)
        assert reader.longest_prefix([m.key for m, _ in chunks], Deadline.after(5)).num_chunks == 0
        res, _ = _read(reader, chunks)
        assert [r.status for r in res] == [Status.MISS] * 2
        reader.close()
    # plain absence (the tier's quiet "missing" count of a file it did not find), never a bad chunk
    assert not any(k.startswith("events.") and k != "events.missing" for k in tm.counts)


def test_corrupted_frame_is_a_counted_miss(tmp_path: Path) -> None:
    chunks = _chunks(2)
    tm = Telemetry()
    tier = _tier(tmp_path, "int8", tm)
    _write(tier, chunks)
    path = next(p for p in tmp_path.rglob("*.kvc") if chunks[1][0].key.hex() in p.name)
    blob = bytearray(path.read_bytes())
    blob[4096 + 100] ^= 0x5A                                     # a byte of the frame: caught by the checksum
    path.write_bytes(bytes(blob))
    res, _ = _read(tier, chunks)
    assert [r.status for r in res] == [Status.HIT, Status.MISS] and tm.counts["events.corrupt"] == 1
    tier.close()


def test_undecodable_frame_is_a_counted_miss(tmp_path: Path) -> None:
    """A frame that passes the checksum but does not decode (a writer's bug) is a miss, removed."""
    chunks = _chunks(1)
    tm = Telemetry()
    tier = _tier(tmp_path, "int8", tm)
    m, p = chunks[0]
    bogus = enc.encode("zstd", p, m.shape, m.dtype)              # the wrong codec, correctly checksummed
    assert tier.inner.put(ChunkMeta(m.key, None, 8, m.shape, m.dtype, len(bogus)), bogus)
    assert tier.inner.flush(30)
    res, _ = _read(tier, chunks)
    assert res[0].status is Status.MISS and res[0].error == "corrupt" and tm.counts["events.corrupt"] == 1
    assert tier.longest_prefix([m.key], Deadline.after(5)).num_chunks == 0
    tier.close()


def test_store_reads_encoded_chunks_from_the_shared_tier(tmp_path: Path) -> None:
    """A writer store (RAM + sharedfs int8) and a reader store whose RAM is empty: the reader's hit comes
    from the shared tier, decoded, within the int8 bound; its RAM copy is the decoded payload."""
    chunks = _chunks(2)
    cfg = StoreConfig.model_validate({"chunk_size": 8, "memory": {"capacity": "1MiB"},
                                      "shared": {"kind": "sharedfs", "path": str(tmp_path), "janitor": False,
                                                 "encoding": "int8"}})
    with TieredStore.open(cfg, NS) as w:
        for m, p in chunks:
            assert w.put(m.key, m.parent, p, num_tokens=8, shape=m.shape, dtype=m.dtype)
        assert w.flush(30)
    with TieredStore.open(cfg, NS) as r:
        keys = [m.key for m, _ in chunks]
        assert r.lookup(keys).num_chunks == 0 and r.shared_prefix(keys, Deadline.after(5)).num_chunks == 2
        outs = [memoryview(bytearray(m.payload_len)) for m, _ in chunks]
        res = r.read_into(keys, outs, Deadline.after(10))
        assert [x.status for x in res] == [Status.HIT] * 2
        for (m, p), o in zip(chunks, outs):
            x, y = np.frombuffer(p, np.float32), np.frombuffer(o, np.float32)
            assert 0 < np.abs(x - y).max() <= np.abs(x).max() / 254 * 1.0001
        assert r.lookup(keys).num_chunks == 2                    # promoted into RAM (decoded)
        assert r.stats()["counters"].get("events.corrupt", 0) == 0
