"""The raw-Mooncake reader: the fast msgspec path gives exactly the checked line-by-line
reader's columns, and bad lines still get a one-line error naming the line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier.sim import trace as T
from kvtier.workload.format import WorkloadError


def _write(path, recs) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))


def test_fast_reader_equals_the_checked_one(tmp_path) -> None:
    p = tmp_path / "mc.jsonl"
    recs = [{"timestamp": 10 * i, "input_length": 512 * (i % 5) + 37 * i, "output_length": i % 3,
             "hash_ids": list(range(i, i + 7)), "extra": "ignored"} for i in range(40)]
    recs.insert(5, "")                                   # a blank line is skipped
    _write(p, recs)
    for scale, unit, limit in ((1, 512, None), (4, 128, None), (1, 512, 9)):
        fast = T._mooncake_columns(p, scale, unit, limit)
        slow = T._mooncake_columns_checked(p, scale, unit, limit)
        assert fast is not None
        for a, b in zip(fast, slow):
            assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bad,needle", [
    ({"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [1]}, ":3: a Mooncake record"),
    ({"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": "abc"}, ":3: a Mooncake record"),
    ({"timestamp": 1, "input_length": 5, "output_length": 1}, ":3: a Mooncake record"),
    ('{"timestamp": 1, "input_len', ":3: not valid JSON"),
    ({"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": ["x"]}, "hash_ids must be integers"),
])
def test_bad_lines_are_named(tmp_path, bad, needle) -> None:
    p = tmp_path / "mc.jsonl"
    good = {"timestamp": 1, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
    _write(p, [good, good, bad, good])
    with pytest.raises(WorkloadError, match=needle.replace("(", r"\(")):
        T.load_mooncake_raw(p)
