"""Circuit breaker of one backend: closed (use it) or open (do not send it new I/O).

A failure (timeout, refused connection, an ``UNAVAILABLE`` answer) opens the breaker; while
open, callers are answered ``UNAVAILABLE("down")`` at once and a background probe (run by the
owner, ``GuardedTier``) asks the backend every ``probe_interval_s``; the first answered probe
closes it. Events are counted **once per burst**: one ``unavailable`` event + one warning when
the breaker opens, one ``recovered`` event + one info line when it closes; the calls refused in
between are only counted (``refused``), never logged one by one.

Side-effect free apart from the counters and log lines; thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.metrics import EVENTS, Telemetry

log = logging.getLogger("kvtier.store")


class Breaker:
    def __init__(self, tier: str, telemetry: Telemetry) -> None:
        self.tier = tier
        self._tm = telemetry
        self._lock = threading.Lock()
        self._open = False
        self._opened_at = 0.0
        self.opened = 0          # bursts so far
        self.refused = 0         # calls answered "down" while open (this burst and earlier)
        self.last_reason = ""

    @property
    def is_open(self) -> bool:
        return self._open

    def trip(self, reason: str) -> bool:
        """Record a failure; True if this opened the breaker (the caller then starts a probe)."""
        with self._lock:
            if self._open:
                return False
            self._open, self._opened_at, self.last_reason = True, time.monotonic(), reason
            self.opened += 1
        self._tm.event("unavailable", self.tier, f"{reason}; no new I/O until a probe answers")
        return True

    def refuse(self) -> None:
        with self._lock:
            self.refused += 1
        self._tm._add(f"refused.{self.tier}")

    def reset(self) -> bool:
        """A probe (or a call) was answered: close. True if it was open."""
        with self._lock:
            if not self._open:
                return False
            self._open = False
            down = time.monotonic() - self._opened_at
        EVENTS.labels("recovered").inc()
        self._tm._add("events.recovered")
        log.info("kvtier: %s tier answers again after %.1f s; resuming I/O", self.tier, down)
        return True
