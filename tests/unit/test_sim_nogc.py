"""kvtier.sim.nogc.gc_paused: the collector is off inside, restored as found outside."""

from __future__ import annotations

import gc

import pytest

from kvtier.sim.nogc import gc_paused


def test_paused_inside_and_restored_after_an_exception() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():                     # nested: still off, and the outer block's state kept
                assert not gc.isenabled()
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_an_already_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
