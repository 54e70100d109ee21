"""``copy_bytes``: the tiers' GIL-releasing chunk copy is an exact ``dst[:] = src``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers.base import COPY_NOGIL_MIN, copy_bytes


@given(n=st.sampled_from([0, 1, COPY_NOGIL_MIN - 1, COPY_NOGIL_MIN, 3 * COPY_NOGIL_MIN + 7]),
       seed=st.integers(0, 255))
def test_copy_is_exact_for_small_and_large(n: int, seed: int) -> None:
    src = bytes((seed + i * 7) % 256 for i in range(n))
    dst = bytearray(n + 8)
    copy_bytes(memoryview(dst)[4:4 + n], memoryview(src))
    assert bytes(dst[4:4 + n]) == src and dst[:4] == b"\0" * 4 and dst[4 + n:] == b"\0" * 4


def test_length_mismatch_and_read_only_raise() -> None:
    big = bytes(2 * COPY_NOGIL_MIN)
    with pytest.raises(ValueError):
        copy_bytes(memoryview(bytearray(len(big) - 1)), big)
    with pytest.raises(ValueError):
        copy_bytes(memoryview(bytes(len(big))), big)
