"""kvtier.sim.lru.LeanLRU evicts exactly like the store's EvictionPolicy("lru").

Hypothesis drives both through random sequences of guarded bounded puts (``put_evicting`` with
an ``exclude`` that rejects a random set of keys, parents drawn among present and absent keys,
so orphans and children-before-parents happen), touches and picks, and asserts the same
return values, contents, children flags and next victim after every step.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.eviction import EvictionPolicy
from kvtier.sim.lru import LeanLRU

ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 15), st.one_of(st.none(), st.integers(0, 15)), st.integers(1, 10),
              st.frozensets(st.integers(0, 15), max_size=4)),
    st.tuples(st.just("touch"), st.integers(0, 15)),
    st.tuples(st.just("pick"), st.frozensets(st.integers(0, 15), max_size=4)),
), min_size=1, max_size=150)


@settings(max_examples=400, deadline=None)
@given(seq=ops)
def test_lean_lru_equals_the_store_policy(seq) -> None:
    a, b = LeanLRU(), EvictionPolicy("lru")
    for op in seq:
        if op[0] == "put":
            _, key, parent, cap, banned = op
            excl = banned.__contains__ if banned else None
            assert a.put_evicting(key, parent, 1, 1, cap, excl) == b.put_evicting(key, parent, 1, 1, cap, excl)
        elif op[0] == "touch":
            a.touch(op[1])
            b.touch(op[1])
        else:
            excl = op[1].__contains__ if op[1] else None
            assert a.pick(excl) == b.pick(excl)
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.has_children(k) == b.has_children(k) for k in range(16))
        assert a.pick() == b.pick()


def test_parent_becomes_a_victim_after_its_last_child() -> None:
    p = LeanLRU()
    for k, parent in ((1, None), (2, 1), (3, 2), (9, None)):
        p.put_evicting(k, parent, 1, 1, 10)
    assert p.pick() == 3                      # the chain tail (1 and 2 have children)
    assert p.put_evicting(10, None, 1, 1, 4) == (True, 1) and 3 not in p
    assert p.pick() == 2                      # 2 is a leaf again, older than 9 and 10


def test_a_parent_touched_after_other_leaves_is_not_evicted_before_them() -> None:
    """A parent that becomes a leaf again keeps its own time: when it was read after another
    leaf was written, that leaf goes first (LeanLRU puts a re-leafed parent at the front of its
    order only when it is older than every leaf there)."""
    for p in (LeanLRU(), EvictionPolicy("lru")):
        for k, parent in ((1, None), (2, 1), (5, None)):
            p.put_evicting(k, parent, 1, 1, 10)
        p.touch(1)                                 # 1 (not a leaf) is now the newest
        assert p.put_evicting(6, None, 1, 1, 3) == (True, 1) and 2 not in p   # 2 was the oldest leaf
        assert p.pick() == 5                       # then 5, older than the re-leafed 1
        assert p.put_evicting(7, None, 1, 1, 3) == (True, 1) and 5 not in p
        assert p.pick() == 1


def test_a_re_leafed_parent_older_than_every_leaf_goes_first() -> None:
    p = LeanLRU()
    for k, parent in ((1, None), (2, 1), (3, 2), (5, None)):
        p.put_evicting(k, parent, 1, 1, 10)
    p.touch(2)
    p.touch(3)                                     # chain read in order: 1 < 5 < 2 < 3 by time
    assert p.put_evicting(6, None, 1, 1, 4) == (True, 1) and 5 not in p
    assert p.put_evicting(7, None, 1, 1, 4) == (True, 1) and 3 not in p
    assert p.pick() == 2 and p.put_evicting(8, None, 1, 1, 4) == (True, 1)
    assert p.pick() == 1                           # 1 re-leafed, older than 6, 7, 8
