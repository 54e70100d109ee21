"""Count-and-log a backend fault once per burst, not once per chunk or per call.

A dead server fails every call until it is back; a shared tier reports the first failure of each
kind as a ``Telemetry.event`` (counted + one log line), stays quiet while the same fault repeats,
and reports again after ``quiet_s`` or after the backend answered in between. ``suppressed``
counts what was held back (for tests and stats). Thread-safe; side-effect free until called.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from kvtier.metrics import Telemetry


class Bursts:
    def __init__(self, telemetry: Telemetry, tier: str, quiet_s: float = 30.0) -> None:
        self._tm = telemetry
        self._tier = tier
        self._quiet_s = quiet_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self.suppressed: Counter[str] = Counter()

    def fault(self, kind: str, detail: str) -> None:
        """Report ``kind`` unless the same fault was reported within the current burst."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._quiet_s:
                self.suppressed[kind] += 1
                return
            self._last[kind] = now
        self._tm.event(kind, self._tier, detail)

    def ok(self, kinds: tuple[str, ...] = ("down", "timeout")) -> None:
        """The backend answered: the next connectivity fault starts a new burst (data faults such as
        ``full`` keep their quiet period: a full server rejects writes while it serves reads)."""
        if self._last:
            with self._lock:
                for kind in kinds:
                    self._last.pop(kind, None)
