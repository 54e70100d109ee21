"""longdoc: columns are built from specs, and a hit column that did not load what it names fails loudly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.demo.common import DemoError
from kvtier.demo.longdoc import COLUMNS, Column, check_hit, expected_hit_tokens


def test_columns_are_specs_with_a_slot_for_more_tiers():
    assert [c.key for c in COLUMNS] == ["recompute", "ram_hit", "ssd_hit"]
    assert COLUMNS[0].tier is None and COLUMNS[1].server == COLUMNS[0].server and COLUMNS[2].server > 1
    shared = Column("shared_hit", "shared tier hit", server=3, tier="sharedfs",
                    kvtier={"store": {"disk": {"enabled": False}}})
    assert len((*COLUMNS, shared)) == 4      # a future column is one more spec, nothing hard-coded to three


def test_expected_tokens_are_the_full_chunks_of_the_shared_prefix():
    doc = list(range(1000))
    assert expected_hit_tokens(doc + [1, 2, 3], doc + [7, 8]) == 896          # 7 full 128-token chunks
    assert expected_hit_tokens(list(range(256)), list(range(256))) == 128     # last token is always computed
    assert expected_hit_tokens([5, 6], [7]) == 0


def _rec(cached):
    return SimpleNamespace(cached_tokens=cached)


def test_a_hit_that_loaded_what_it_names_passes():
    check_hit(COLUMNS[2], "d000", _rec(896), 896, {"disk": 896.0}, {"disk": 7.0})
    check_hit(COLUMNS[1], "d000", _rec(896), 896, {"worker": 896.0}, {"memory": 7.0})
    check_hit(COLUMNS[0], "d000", _rec(0), 0, {}, {})


@pytest.mark.parametrize("col,cached,admitted,read,msg", [
    (COLUMNS[2], 896, {"disk": 896.0}, {"memory": 7.0}, "disk tier"),       # read from RAM, labelled SSD
    (COLUMNS[2], 0, {}, {}, "disk tier"),                                   # nothing loaded
    (COLUMNS[1], 512, {"memory": 512.0}, {"memory": 4.0}, "memory tier"),   # too few tokens
    (COLUMNS[1], 896, {"memory": 384.0}, {"memory": 7.0}, "memory tier"),   # server says more than kvtier admitted
    (COLUMNS[1], None, {"memory": 896.0}, {"memory": 7.0}, "no cached_tokens"),
    (COLUMNS[0], 128, {"memory": 128.0}, {"memory": 1.0}, "expected a recompute"),
    (COLUMNS[0], 0, {}, {"disk": 1.0}, "expected a recompute"),
])
def test_a_hit_column_that_did_not_load_what_it_names_fails_loudly(col, cached, admitted, read, msg):
    with pytest.raises(DemoError, match=msg):
        check_hit(col, "d000", _rec(cached), 0 if col.tier is None else 896, admitted, read)
