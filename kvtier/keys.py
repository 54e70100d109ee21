"""Deterministic chunk keys and the namespace that separates incompatible KV.

A prompt's token ids are cut into chunks of ``namespace.chunk_size`` tokens; only
full chunks get a key. Chunk ``i``'s key is a chained BLAKE2b-256 digest::

    key[0] = BLAKE2b-256(namespace.digest() || u32le(tokens[0:C])   || extra)
    key[i] = BLAKE2b-256(key[i-1]           || u32le(tokens[iC:(i+1)C]) || extra)

so a key names the whole prefix up to and including its chunk, and two prompts
share keys exactly as long as they share full chunks (and ``extra``: LoRA id,
multimodal hashes, cache salt; callers encode it canonically). Every input is
explicit bytes: no Python ``hash()``, no PYTHONHASHSEED, the same on every machine.
Test vectors live in tests/unit/test_keys.py.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import NewType, Sequence

import numpy as np

from kvtier import FORMAT_VERSION

ChunkKey = NewType("ChunkKey", bytes)  # 32-byte BLAKE2b digest
KEY_BYTES = 32
_NS_PERSON = b"kvtier-ns"      # BLAKE2b personalisation: namespace digests never collide with chunk keys
_MAX_TOKEN = 2**32 - 1
_U32 = "I" if array.array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two KV payloads incompatible.

    Chunks are only ever returned to a store opened with an equal namespace: the
    digest is the root of every key chain, names the on-disk sub-directory, and is
    written into (and verified from) every chunk header.
    """

    model: str
    model_fingerprint: str      # weights revision / content hash
    dtype: str                  # KV dtype, e.g. "bfloat16"
    layout: str                 # KV layout, e.g. "vllm-cpu-v1:[2,L,B,H,D]"
    block_size: int             # engine block size (tokens)
    chunk_size: int             # tokens per chunk; a multiple of block_size
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    format_version: int = FORMAT_VERSION
    deployment: str = ""        # deployment-wide prefix (store.deployment): separate deployments sharing one
                                # backend never read each other's chunks, even for equal prompts and salts
    encoding: str = "plain"     # payload encoding (store.shared.encoding): only a shared tier's namespace
                                # names another one, so readers never mix encodings

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0:
            raise ValueError(f"block_size and chunk_size must be > 0, got {self.block_size}, {self.chunk_size}")
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} is not a multiple of block_size {self.block_size}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError("tp_rank/pp_rank out of range")
        if not self.encoding:
            raise ValueError("encoding must be a non-empty name (\"plain\" for none)")

    def canonical_bytes(self) -> bytes:
        """Canonical encoding: sorted-key compact JSON of every field (UTF-8). An empty ``deployment``
        and the ``plain`` encoding are left out, so namespaces without them keep the digests they
        always had."""
        fields = asdict(self)
        if not fields["deployment"]:
            del fields["deployment"]
        if fields["encoding"] == "plain":
            del fields["encoding"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @cached_property
    def _digest(self) -> bytes:
        return hashlib.blake2b(self.canonical_bytes(), digest_size=KEY_BYTES, person=_NS_PERSON).digest()

    def with_encoding(self, encoding: str) -> "Namespace":
        """This namespace for payloads stored in ``encoding`` (itself for ``plain``)."""
        return self if encoding == self.encoding else replace(self, encoding=encoding)

    def digest(self) -> bytes:
        """32-byte digest of the canonical encoding; the root parent of every key chain."""
        return self._digest

    def short_id(self) -> str:
        """16 hex chars of the digest: the namespace's sub-directory name."""
        return self._digest[:8].hex()


def _token_bytes(token_ids: Sequence[int] | np.ndarray, n: int) -> bytes:
    """uint32 little-endian bytes of the first ``n`` tokens; rejects ids outside [0, 2**32)."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids[:n]
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
            raise ValueError("token ids must be in [0, 2**32)")
        return arr.astype("<u4", copy=False).tobytes()
    try:  # array('I') converts a list ~3x faster than numpy and range-checks every id
        arr32 = array.array(_U32, token_ids[:n] if len(token_ids) != n else token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    if _BIG_ENDIAN:
        arr32.byteswap()
    return arr32.tobytes()


def chunk_key(parent: bytes, tokens_u32le: bytes, extra: bytes = b"") -> ChunkKey:
    """One link of the chain: BLAKE2b-256(parent || u32le tokens || extra)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(tokens_u32le)
    if extra:
        h.update(extra)
    return ChunkKey(h.digest())


def chunk_keys(namespace: Namespace, token_ids: Sequence[int], extra: bytes = b"") -> list[ChunkKey]:
    """One key per FULL chunk of ``namespace.chunk_size`` tokens (a trailing partial chunk gets none)."""
    c = namespace.chunk_size
    n = (len(token_ids) // c) * c
    if n == 0:
        return []
    raw = memoryview(_token_bytes(token_ids, n))
    step = 4 * c
    parent = namespace.digest()
    keys: list[ChunkKey] = []
    blake = hashlib.blake2b
    for off in range(0, len(raw), step):
        h = blake(parent, digest_size=KEY_BYTES)
        h.update(raw[off:off + step])
        if extra:
            h.update(extra)
        parent = h.digest()
        keys.append(ChunkKey(parent))
    return keys


def extend_chunk_keys(namespace: Namespace, keys: list[ChunkKey], token_ids: Sequence[int], upto: int,
                      extra: bytes = b"") -> int:
    """Append to ``keys`` (the chained keys of ``token_ids``' first ``len(keys)`` chunks) the keys of
    chunks ``len(keys) .. upto - 1``, as far as ``token_ids`` has full chunks; returns how many were
    added. The result equals ``chunk_keys(namespace, token_ids[:upto * C], extra)``: a request's keys
    grow as it generates tokens, without rehashing its prefix."""
    c = namespace.chunk_size
    upto = min(upto, len(token_ids) // c)
    start = len(keys)
    if upto <= start:
        return 0
    raw = memoryview(_token_bytes(token_ids[start * c:upto * c], (upto - start) * c))
    parent = keys[-1] if keys else namespace.digest()
    step = 4 * c
    for off in range(0, len(raw), step):
        parent = chunk_key(parent, raw[off:off + step], extra)
        keys.append(parent)
    return upto - start


def parent_of(namespace: Namespace, keys: Sequence[ChunkKey], index: int) -> ChunkKey | None:
    """The parent key of ``keys[index]``: the previous key, or None for the first chunk."""
    return keys[index - 1] if index > 0 else None
