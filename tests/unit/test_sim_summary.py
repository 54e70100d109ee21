"""The simulator's summary helpers agree with numpy on the arrays they stand for."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sim.summary import _lat, _lat_weighted


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.integers(0, 40)), min_size=1, max_size=60))
def test_weighted_latency_equals_numpy_on_the_repeated_array(rows) -> None:
    v = np.array([r[0] for r in rows])
    w = np.array([r[1] for r in rows])
    got = _lat_weighted(v, w, "itl")
    want = _lat(np.repeat(v, w), "itl")
    for k, x in want.items():
        if x is None:
            assert got[k] is None
        else:
            assert abs(got[k] - x) <= 1e-9 * max(1.0, abs(x)), (k, got[k], x)
