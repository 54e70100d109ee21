"""Eviction policies in isolation: leaves only, LRU order, GDSF cost/frequency order."""

from __future__ import annotations

import pytest

from kvtier.eviction import EvictionPolicy


def k(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


@pytest.mark.parametrize("name", ["lru", "cost"])
def test_only_leaves_and_tails_first(name: str) -> None:
    p = EvictionPolicy(name)
    p.add(k("a"), None, 100, 4)
    p.add(k("b"), k("a"), 100, 4)
    p.add(k("c"), k("b"), 100, 4)
    order = []
    while (v := p.pick()) is not None:
        order.append(v)
        p.remove(v)
    assert order == [k("c"), k("b"), k("a")]          # a chain is eaten from its tail


def test_lru_picks_least_recent_leaf_and_respects_exclude() -> None:
    p = EvictionPolicy("lru")
    for n in "xyz":
        p.add(k(n), None, 100, 4)
    p.touch(k("x"))
    assert p.pick() == k("y")
    assert p.pick(exclude=lambda key: key == k("y")) == k("z")
    p.remove(k("y"))
    assert p.pick() == k("z")


def test_cost_keeps_frequently_hit_and_expensive_chunks() -> None:
    p = EvictionPolicy("cost")
    p.add(k("hot"), None, 100, 4)
    p.add(k("cold"), None, 100, 4)
    for _ in range(5):
        p.touch(k("hot"))
    assert p.pick() == k("cold")
    q = EvictionPolicy("cost")                          # same hits: the deeper (costlier) leaf stays
    q.add(k("root"), None, 100, 256)
    q.add(k("deep"), k("root"), 100, 256)
    q.add(k("shallow"), None, 100, 256)
    assert q.pick() == k("shallow")


def test_parent_becomes_candidate_when_last_child_leaves() -> None:
    p = EvictionPolicy("lru")
    p.add(k("a"), None, 1)
    p.add(k("b"), k("a"), 1)
    p.add(k("b2"), k("a"), 1)
    assert not p.is_leaf(k("a")) and p.has_children(k("a"))
    p.remove(k("b"))
    assert not p.is_leaf(k("a"))
    p.remove(k("b2"))
    assert p.is_leaf(k("a")) and p.pick() == k("a")
    assert p.descendants(k("zzz")) == []


def test_heap_stays_bounded_under_many_touches() -> None:
    p = EvictionPolicy("lru")
    for i in range(10):
        p.add(k(str(i)), None, 1)
    for _ in range(10_000):
        p.touch(k("3"))
    assert len(p._heap) <= 4 * len(p) + 64 + 1
    assert p.pick() == k("0")
