"""Vectorized prefix hashes: equal prefixes hash equal across requests, any change differs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from kvtier.sim.hashing import prefix_hashes


def _one(v: list[int], unit: int) -> list[int]:
    h, _ = prefix_hashes(np.asarray(v, dtype=np.int64), np.array([0, len(v)]), unit)
    return h.tolist()


def test_shared_prefixes_share_hashes_across_segments() -> None:
    a = list(range(100, 140))
    b = a[:24] + [7] * 16
    v = np.array(a + b, dtype=np.int64)
    h, off = prefix_hashes(v, np.array([0, 40, 80]), 8)
    ha, hb = h[off[0]:off[1]].tolist(), h[off[1]:off[2]].tolist()
    assert len(ha) == len(hb) == 5
    assert ha[:3] == hb[:3] and all(x != y for x, y in zip(ha[3:], hb[3:]))
    assert len(set(ha)) == 5                         # a prefix and its extension differ


def test_partial_tail_units_are_not_hashed() -> None:
    h, off = prefix_hashes(np.arange(21), np.array([0, 5, 21]), 4)
    assert off.tolist() == [0, 1, 5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50000), min_size=1, max_size=64), st.integers(1, 8), st.data())
def test_batched_equals_single_and_a_change_breaks_the_chain(vals, unit, data) -> None:
    other = data.draw(st.lists(st.integers(0, 50000), min_size=0, max_size=40))
    both, off = prefix_hashes(np.array(other + vals, dtype=np.int64), np.array([0, len(other), len(other) + len(vals)]),
                              unit)
    assert both[off[1]:off[2]].tolist() == _one(vals, unit)
    i = data.draw(st.integers(0, len(vals) - 1))
    changed = list(vals)
    changed[i] += 1
    h0, h1 = _one(vals, unit), _one(changed, unit)
    first_bad = i // unit
    assert h0[:first_bad] == h1[:first_bad]
    assert all(x != y for x, y in zip(h0[first_bad:], h1[first_bad:]))


def test_batches_of_segments_give_the_one_pass_hashes(monkeypatch) -> None:
    import kvtier.sim.hashing as H
    rng = np.random.default_rng(5)
    lens = rng.integers(0, 60, size=300)
    lens[7] = 500                                       # one segment longer than a batch
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    vals = rng.integers(0, 1 << 40, size=int(off[-1]))
    for unit in (1, 4, 16):
        want = H._prefix_hashes(vals, off, unit)
        monkeypatch.setattr(H, "_BLOCK", 97)
        got = H.prefix_hashes(vals, off, unit)
        monkeypatch.setattr(H, "_BLOCK", 1 << 20)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
