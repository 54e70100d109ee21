"""The preemption drill's audit (tests/integration/drill_driver.py::audit_objects, which
``audit_worker`` runs over every live object of vLLM's worker process) sees a held pin and a slot
neither free nor owned: the drill's "nothing leaked" assertions can fail.

The audit is given the tier itself, not ``gc.get_objects()``: in a unit-suite process that has run
hundreds of tests, an isinstance() over every live object took over 120 s on a slow CI machine, and
other tests' leftover tiers would make the baseline move under it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from drill_driver import audit_objects  # noqa: E402

from kvtier.chunk import ChunkMeta  # noqa: E402
from kvtier.keys import ChunkKey  # noqa: E402
from kvtier.tiers.memory import MemoryTier  # noqa: E402


def _mine(m: MemoryTier) -> dict:
    a = audit_objects([m])
    assert a["memory_tiers"] == 1
    return {k: a[k] for k in ("pinned_slots", "slots", "slots_free_or_owned")}


def test_audit_sees_a_held_pin_and_a_lost_slot():
    m = MemoryTier.open(16 * 4096)
    key = ChunkKey(os.urandom(32))
    assert m.put(ChunkMeta(key, None, 16, (4096,), "uint8", 4096), b"x" * 4096)
    base = _mine(m)
    held = m.pin(key)
    assert held is not None
    assert _mine(m)["pinned_slots"] == base["pinned_slots"] + 1
    held[2]()                                            # released: back to the baseline
    assert _mine(m) == base
    m._free.pop()                                        # a slot lost (neither free nor owned)
    lost = _mine(m)
    assert lost["slots_free_or_owned"] == base["slots_free_or_owned"] - 1 and lost["slots"] == base["slots"]
    m.close()
