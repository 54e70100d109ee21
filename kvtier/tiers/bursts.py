"""A backend's faults: counted every time, logged once per burst.

A dead server fails every call until it is back. Every failure is counted (``kvtier_events_total``
and the store's ``stats()``, through ``Telemetry.event``); the first of each kind in a burst logs a
warning, the repeats only count and are summarised in the next warning. A burst ends after
``Telemetry.LOG_BURST_S`` of quiet, or when the backend answered in between (``ok``, ``resumed``),
so the next fault after a recovery logs again at once. ``suppressed`` counts the occurrences that
did not log (for tests and stats). Thread-safe; side-effect free until called.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvtier.metrics import Telemetry

log = logging.getLogger("kvtier")


class Bursts:
    def __init__(self, telemetry: Telemetry, tier: str) -> None:
        self._tm = telemetry
        self._tier = tier
        self._lock = threading.Lock()
        self.suppressed: Counter[str] = Counter()
        self._open: set[str] = set()     # kinds whose burst this tier opened (ok()'s fast path)

    def fault(self, kind: str, detail: str, n: int = 1) -> None:
        """Count ``n`` occurrences of ``kind``; log unless a burst of the same fault is open."""
        logged = self._tm.event(kind, self._tier, detail, n)
        with self._lock:
            if logged:
                self._open.add(kind)
            held = n - 1 if logged else n
            if held:
                self.suppressed[kind] += held

    def ok(self, kinds: tuple[str, ...] = ("down", "timeout")) -> None:
        """The backend answered: the next connectivity fault starts a new burst (data faults such as
        ``full`` keep their burst: a full server rejects writes while it serves reads)."""
        if not self._open:      # the common case: nothing to end, no lock taken
            return
        for kind in kinds:
            self._end(kind)

    def resumed(self, kind: str, detail: str) -> None:
        """The condition ``kind`` ended: log it (info) if it had been reported; the next one logs again."""
        if self._end(kind):
            log.info("kvtier %s tier: %s", self._tier, detail)

    def _end(self, kind: str) -> bool:
        with self._lock:
            self._open.discard(kind)
        return self._tm.burst_over(kind, self._tier)
