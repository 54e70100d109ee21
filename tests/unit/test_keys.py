"""Chunk keys: published test vectors, determinism across processes, canonical inputs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.keys import Namespace, chunk_keys

NS = Namespace("SmolLM2-135M-Instruct", "rev-abc", "bfloat16", "vllm-cpu-v1", 16, 256)
NS4 = Namespace("m", "f", "float32", "L", 4, 4)

# Test vectors: anyone re-implementing kvtier keys must reproduce these.
VECTORS = {
    "ns_digest": "8de3eab93a72effd0463f3043699a489f1c7f037a84b115975e3d6983da5460c",
    "ns_short_id": "8de3eab93a72effd",
    "range512": ["e2f1c5b01c7431a079a5d1e636c35bdc4a5bd33ac61866ccef3c56121108b7c5",
                 "a40ec217f00d60ae2f1fc035ffaa57ab2546dfb42bfcb0ddeefd95befca76b53"],
    "range256_extra_lora7": "7e6c2d9c1f695573228fb5b466083dfcb6155bd4756099d605698df79e4455df",
    "ns4_1to9": ["fbba5394fad0136874e2091ef3dcc70d6fa7e29116edb170859e9fe57e01b187",
                 "9e2ede1ae63551ae40cf85a047c212ea77340fc2bd1fa1748ca9bab84bcab81d"],
}


def test_vectors() -> None:
    assert NS.digest().hex() == VECTORS["ns_digest"]
    assert NS.short_id() == VECTORS["ns_short_id"]
    assert [k.hex() for k in chunk_keys(NS, list(range(512)))] == VECTORS["range512"]
    assert chunk_keys(NS, list(range(256)), extra=b"lora:7")[0].hex() == VECTORS["range256_extra_lora7"]
    assert [k.hex() for k in chunk_keys(NS4, [1, 2, 3, 4, 5, 6, 7, 8, 9])] == VECTORS["ns4_1to9"]


def test_keys_follow_the_documented_formula() -> None:
    """Recompute from the spec with hashlib only: canonical JSON -> root, then the chain."""
    canon = json.dumps({"block_size": 4, "chunk_size": 4, "dtype": "float32", "format_version": 1,
                        "layout": "L", "model": "m", "model_fingerprint": "f", "pp_rank": 0, "pp_size": 1,
                        "tp_rank": 0, "tp_size": 1}, sort_keys=True, separators=(",", ":")).encode()
    root = hashlib.blake2b(canon, digest_size=32, person=b"kvtier-ns").digest()
    assert NS4.digest() == root
    k0 = hashlib.blake2b(root + b"".join(i.to_bytes(4, "little") for i in (1, 2, 3, 4)), digest_size=32).digest()
    k1 = hashlib.blake2b(k0 + b"".join(i.to_bytes(4, "little") for i in (5, 6, 7, 8)), digest_size=32).digest()
    assert chunk_keys(NS4, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == [k0, k1]


def test_stable_across_processes_and_hash_seeds() -> None:
    code = ("from kvtier.keys import Namespace, chunk_keys;"
            "ns=Namespace('SmolLM2-135M-Instruct','rev-abc','bfloat16','vllm-cpu-v1',16,256);"
            "print(chunk_keys(ns, list(range(512)))[1].hex())")
    for seed in ("0", "1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == VECTORS["range512"][1]


def test_only_full_chunks_and_prefix_sharing() -> None:
    a = chunk_keys(NS, list(range(700)))
    b = chunk_keys(NS, list(range(512)) + [9] * 300)
    assert len(a) == 2 and len(chunk_keys(NS, list(range(255)))) == 0
    assert a == b[:2]                      # same full chunks -> same keys
    c = chunk_keys(NS, [1] + list(range(1, 512)))
    assert c[0] != a[0] and c[1] != a[1]   # a change in chunk 0 changes every later key


def test_numpy_and_list_inputs_agree() -> None:
    toks = np.random.default_rng(0).integers(0, 2**32, size=1024, dtype=np.uint64)
    assert chunk_keys(NS, toks) == chunk_keys(NS, [int(t) for t in toks])


# one valid alternative value per Namespace field, each changed ALONE (a base with tp/pp size 2 lets
# the ranks and the sizes vary independently)
_BASE = dataclasses.replace(NS, tp_size=2, pp_size=2)
_ALONE = {"model": "other-model", "model_fingerprint": "rev-x", "dtype": "float16", "layout": "other",
          "block_size": 32, "chunk_size": 512, "tp_rank": 1, "tp_size": 4, "pp_rank": 1, "pp_size": 4,
          "format_version": _BASE.format_version + 1, "deployment": "prod-eu", "encoding": "int8"}


def test_every_namespace_field_is_varied_alone() -> None:
    """A new Namespace field must be added to _ALONE (so it is shown to change the key)."""
    assert set(_ALONE) == {f.name for f in dataclasses.fields(Namespace)}


@pytest.mark.parametrize("field", sorted(_ALONE))
def test_each_namespace_field_alone_changes_every_key(field: str) -> None:
    toks = list(range(1024))
    base = chunk_keys(_BASE, toks)
    other = dataclasses.replace(_BASE, **{field: _ALONE[field]})
    assert [f for f in dataclasses.fields(Namespace) if getattr(other, f.name) != getattr(_BASE, f.name)] == \
        [next(f for f in dataclasses.fields(Namespace) if f.name == field)]      # exactly one field differs
    assert other.digest() != _BASE.digest()
    keys = chunk_keys(other, toks)
    assert keys and not set(keys) & set(base)            # every key differs, not only the first


def test_extra_separates_keys() -> None:
    toks = list(range(256))
    assert chunk_keys(NS, toks, extra=b"salt")[0] != chunk_keys(NS, toks)[0]


@pytest.mark.parametrize("bad", [[-1] * 256, [2**32] * 256])
def test_out_of_range_tokens_rejected(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        chunk_keys(NS, bad)
    with pytest.raises(ValueError):
        chunk_keys(NS, np.array(bad, dtype=np.int64))


def test_namespace_validation() -> None:
    with pytest.raises(ValueError):
        Namespace("m", "f", "bf16", "L", 16, 100)
    with pytest.raises(ValueError):
        Namespace("m", "f", "bf16", "L", 16, 256, tp_rank=2, tp_size=2)
