"""Pausing Python's cyclic garbage collector around a simulation or a trace load.

A big trace or simulation holds millions of container objects (a record and its hash-id list
per request, a ``[parent, time]`` entry per chunk a tier holds) and creates no reference
cycles worth collecting; every collection of the oldest generation walks all of them, so
with the collector on, loading a 1M-request Mooncake trace took ~3x its time without it
(200K requests: 1.8 vs 0.6 CPU-s). Nothing the simulator computes depends on it: results are
the same with or without (tests/unit/test_sim_golden.py runs with it).

``gc_paused()`` disables the collector for the block and restores the previous state on the
way out (nested use and an already-disabled collector are left as found). Process-wide for
the block's duration: other threads' cycles wait until the block ends, then are collected.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
