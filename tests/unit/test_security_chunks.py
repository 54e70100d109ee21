"""Security of cache bytes: signed chunks (keyed BLAKE3), fuzzed readers, deployment prefixes.

Threat: anyone who can write a tier can compute a prompt's chunk key and plant KV there. A checksum
does not stop that; a MAC with a deployment secret does. And no byte read from a tier may make a
reader raise, allocate past the sizes it checked, or run code.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import chunk
from kvtier.chunk import FLAG_MAC, HEADER_SIZE, ChunkError, ChunkMeta, decode, encode
from kvtier.config import ConfigError, StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.security import signing_secret
from kvtier.store import TieredStore

NS = Namespace("m", "f", "float32", "L", 4, 4)
SECRET = "s3cret-deployment-key-0123456789"
P = 6000


def disk_cfg(tmp: Path, **store) -> StoreConfig:
    return StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False},
                                       "disk": {"enabled": True, "path": str(tmp), "capacity": 10**8}, **store})


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()


@pytest.fixture(autouse=True)
def _no_leftover_keys():
    yield
    chunk._mac_keys.clear()


def _events(store: TieredStore, kind: str) -> int:
    return store.stats()["counters"].get(f"events.{kind}", 0)


def _put_one(store: TieredStore, i: int = 0):
    key = chunk_keys(NS, list(range(4 * (i + 1))))[i]
    assert store.put(key, None if i == 0 else None, payload(i), num_tokens=4, shape=(P,), dtype="uint8")
    assert store.flush(10)
    return key


def _disk(store: TieredStore):
    return store.disk


def test_signed_chunks_round_trip_and_carry_the_flag(tmp_path):
    with TieredStore.open(disk_cfg(tmp_path, signing_key=SECRET), NS) as s:
        key = _put_one(s)
        raw = Path(_disk(s).path_of(key)).read_bytes()
        assert int.from_bytes(raw[8:12], "little") & FLAG_MAC
        out = bytearray(P)
        assert s.get_into(key, out) == P and bytes(out) == payload(0)


def test_planted_chunk_signed_with_the_wrong_key_is_a_counted_miss(tmp_path):
    with TieredStore.open(disk_cfg(tmp_path, signing_key=SECRET), NS) as s:
        key = _put_one(s)
        path = Path(_disk(s).path_of(key))
        evil = payload(99)
        # a well-formed chunk for the same key, signed with a key the deployment does not hold
        path.write_bytes(encode(NS.digest(), ChunkMeta(key, None, 4, (P,), "uint8", P), evil,
                                mac_key=b"attacker-key-0123456789abcdef"))
        before = _events(s, "bad_signature")
        out = bytearray(P)
        assert s.get_into(key, out) is None
        assert _events(s, "bad_signature") == before + 1


def test_planted_unsigned_chunk_in_a_signed_namespace_is_a_counted_miss(tmp_path):
    with TieredStore.open(disk_cfg(tmp_path, signing_key=SECRET), NS) as s:
        key = _put_one(s)
        path = Path(_disk(s).path_of(key))
        chunk._mac_keys.clear()                     # the attacker's process: no key -> plain checksum
        blob = encode(NS.digest(), ChunkMeta(key, None, 4, (P,), "uint8", P), payload(98))
        chunk.register_mac_key(NS.digest(), SECRET.encode())
        assert not int.from_bytes(blob[8:12], "little") & FLAG_MAC
        path.write_bytes(blob)
        assert s.get_into(key, bytearray(P)) is None
        assert _events(s, "unsigned") == 1


def test_signed_chunk_without_the_key_is_a_miss_not_an_error(tmp_path):
    with TieredStore.open(disk_cfg(tmp_path, signing_key=SECRET), NS) as s:
        key = _put_one(s)
    with TieredStore.open(disk_cfg(tmp_path), NS) as s:     # a reader configured without the secret
        assert s.get_into(key, bytearray(P)) is None
        assert _events(s, "signed_no_key") == 1


def test_blob_decode_refuses_wrong_mac_and_unsigned(tmp_path):
    meta = ChunkMeta(chunk_keys(NS, [1, 2, 3, 4])[0], None, 4, (P,), "uint8", P)
    good = encode(NS.digest(), meta, payload(1), mac_key=SECRET.encode())
    chunk.register_mac_key(NS.digest(), SECRET.encode())
    got, view = decode(NS.digest(), good, meta.key)
    assert got == meta and bytes(view) == payload(1)
    with pytest.raises(ChunkError) as e:
        decode(NS.digest(), encode(NS.digest(), meta, payload(1), mac_key=b"x" * 32), meta.key)
    assert e.value.kind == "bad_signature"
    chunk.register_mac_key(NS.digest(), None)
    plain = encode(NS.digest(), meta, payload(1))
    chunk.register_mac_key(NS.digest(), SECRET.encode())
    with pytest.raises(ChunkError) as e:
        decode(NS.digest(), plain, meta.key)
    assert e.value.kind == "unsigned"


def test_signing_key_sources_and_errors(tmp_path):
    f = tmp_path / "key"
    f.write_text("k" * 32)
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="group or others"):
        signing_secret(StoreConfig(signing_key_file=f))
    f.chmod(0o600)
    assert signing_secret(StoreConfig(signing_key_file=f)) == b"k" * 32
    with pytest.raises(ValueError, match="at least 16"):
        StoreConfig(signing_key="short")
    assert "s3cret" not in repr(StoreConfig(signing_key=SECRET))
    assert "s3cret" not in StoreConfig(signing_key=SECRET).model_dump_json()


# -- fuzz: every reader returns a valid chunk or a miss, never raises ---------------------------
def _valid_blob() -> tuple[ChunkMeta, bytes]:
    meta = ChunkMeta(chunk_keys(NS, [5, 6, 7, 8])[0], None, 4, (64,), "uint8", 64)
    return meta, encode(NS.digest(), meta, bytes(range(64)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=HEADER_SIZE + 200))
def test_decode_of_random_bytes_is_a_chunk_error(data):
    with pytest.raises(ChunkError):
        decode(NS.digest(), data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decode_of_mutated_chunks_never_returns_other_bytes(data):
    meta, blob = _valid_blob()
    b = bytearray(blob)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "header_field"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    elif kind == "extend":
        b += data.draw(st.binary(min_size=1, max_size=64))
    else:   # a header size field set to something huge: must not allocate from it
        off = data.draw(st.sampled_from([112, 116, 124, 141]))
        b[off:off + 8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    if bytes(b) == blob:
        return
    with pytest.raises(ChunkError):
        decode(NS.digest(), bytes(b), meta.key)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=HEADER_SIZE + 9000), flip=st.integers(0, 2**31))
def test_disk_tier_reads_of_garbage_files_are_misses(tmp_path, data, flip):
    with TieredStore.open(disk_cfg(tmp_path), NS) as s:
        key = _put_one(s)
        path = Path(_disk(s).path_of(key))
        good = path.read_bytes()
        if data and flip % 2:      # mutate the real chunk
            b = bytearray(good)
            b[flip % len(b)] ^= 0x5A
            data = bytes(b)
        path.write_bytes(data)
        out = bytearray(P)
        n = s.get_into(key, out)          # never raises
        if data == good:
            assert n == P and bytes(out) == payload(0)
        else:
            assert n is None
        assert s.get(key) is None or data == good


def test_no_code_executing_deserializer_in_kvtier():
    """Cache bytes are parsed by struct only: no pickle/marshal/eval/unsafe yaml/torch.load in kvtier."""
    root = Path(__file__).resolve().parents[2] / "kvtier"
    bad = re.compile(r"^\s*(import|from)\s+(pickle|marshal|shelve|dill|cloudpickle)\b|"
                     r"\b(pickle|marshal|dill|cloudpickle)\.(loads?|Unpickler)\b|(?<![.\w])eval\(|(?<![.\w])exec\(|"
                     r"yaml\.load\(|yaml\.unsafe_load|torch\.load\((?![^)]*weights_only=True)")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if bad.search(line) and not line.lstrip().startswith("#")]
    assert hits == []


def test_deployment_prefix_separates_namespaces_and_keeps_old_digests():
    base = Namespace("m", "f", "float32", "L", 4, 4)
    a = Namespace("m", "f", "float32", "L", 4, 4, deployment="team-a")
    b = Namespace("m", "f", "float32", "L", 4, 4, deployment="team-b")
    assert len({base.digest(), a.digest(), b.digest()}) == 3
    assert b"deployment" not in base.canonical_bytes()     # unchanged digests for every existing cache
    toks = list(range(8))
    assert chunk_keys(a, toks)[0] != chunk_keys(b, toks)[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=HEADER_SIZE + 9000), flip=st.integers(0, 2**31))
def test_sharedfs_tier_reads_of_garbage_files_are_misses(tmp_path, data, flip):
    """The shared-filesystem reader (any machine can write the mount) on random / mutated files."""
    from kvtier.config import SharedFsConfig
    from kvtier.tiers.protocol import Deadline, Status, WriteItem
    from kvtier.tiers.sharedfs import SharedFsTier

    import uuid

    mnt = tmp_path / uuid.uuid4().hex
    mnt.mkdir()                                   # the "mount" exists (a missing one starts the tier down)
    tier = SharedFsTier.open(SharedFsConfig(path=mnt, janitor=False), NS)
    try:
        key = chunk_keys(NS, [1, 2, 3, 4])[0]
        meta = ChunkMeta(key, None, 4, (P,), "uint8", P)
        assert tier.write([WriteItem(meta, memoryview(payload(0)))]) == [True] and tier.flush(10)
        path = Path(tier.layout.path_of(key))
        good = path.read_bytes()
        if data and flip % 2:
            b = bytearray(good)
            b[flip % len(b)] ^= 0x5A
            data = bytes(b)
        path.write_bytes(data)
        out = bytearray(P)
        (res,) = tier.read_into([key], [memoryview(out)], Deadline.after(10))     # never raises
        if data == good:
            assert res.status is Status.HIT and bytes(out) == payload(0)
        else:
            assert res.status is not Status.HIT
    finally:
        tier.close()
