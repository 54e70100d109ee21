"""Prometheus metrics of the store, plus a per-store plain-dict mirror for ``stats()``.

All metrics live in prometheus-client's default registry (so the connector's own
metrics and ``prometheus_client.start_http_server`` see them) and are prefixed
``kvtier_``. Failures of a cache path are counted in ``kvtier_events_total{kind}``:

    corrupt, torn, wrong_key, version, namespace_mismatch   a chunk failed verification (removed)
    missing       an indexed chunk vanished (evicted by another process, deleted by hand)
    enospc        the disk was full while writing a chunk (the write is dropped)
    io_error      any other OSError on a chunk path (a miss / dropped write)
    dropped_store a put was dropped: write queue full, no free memory slot, too large
    orphan_put    a put whose parent chunk is nowhere in the store (dropped: it could never be hit)
    orphan_evicted a chunk removed because its parent left every tier
    temp_cleaned  temp files of dead writers removed at open
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram

log = logging.getLogger("kvtier.store")

_LAT_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)

STORE_LOOKUPS = PCounter("kvtier_store_lookups_total", "Store prefix lookups")
STORE_LOOKUP_CHUNKS = PCounter("kvtier_store_lookup_chunks_total", "Chunks asked for in lookups, by result",
                               ["result"])
STORE_HITS = PCounter("kvtier_store_hits_total", "Chunk reads served, by tier", ["tier"])
STORE_MISSES = PCounter("kvtier_store_misses_total", "Chunk reads not served, by tier", ["tier"])
BYTES_READ = PCounter("kvtier_store_read_bytes_total", "Payload bytes read, by tier", ["tier"])
BYTES_WRITTEN = PCounter("kvtier_store_written_bytes_total", "Payload bytes written, by tier", ["tier"])
GET_SECONDS = Histogram("kvtier_store_get_seconds", "Per-chunk get latency, by tier", ["tier"],
                        buckets=_LAT_BUCKETS)
PUT_SECONDS = Histogram("kvtier_store_put_seconds", "Per-chunk put latency, by tier", ["tier"],
                        buckets=_LAT_BUCKETS)
EVENTS = PCounter("kvtier_events_total", "Failures and notable events on cache paths, by kind", ["kind"])
EVICTIONS = PCounter("kvtier_store_evictions_total", "Chunks evicted, by tier", ["tier"])
USAGE_BYTES = Gauge("kvtier_tier_usage_bytes", "Bytes used by a tier (last store to report)", ["tier"])
CAPACITY_BYTES = Gauge("kvtier_tier_capacity_bytes", "Byte budget of a tier", ["tier"])
QUEUE_DEPTH = Gauge("kvtier_store_write_queue_depth", "Background disk writes queued")


class Telemetry:
    """One store's counters: every call updates Prometheus and a plain dict for ``stats()``.

    Thread-safe. ``event()`` also logs (warning for data faults, debug for drops).
    """

    _QUIET = frozenset({"dropped_store", "missing", "orphan_evicted", "orphan_put"})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}   # (kind, tier) -> (warned at, held back)

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    #: a data-fault warning is logged once per (kind, tier) per burst of this many seconds;
    #: the events in between are counted (always) and logged at debug level
    LOG_BURST_S = 30.0

    def event(self, kind: str, tier: str = "", detail: str = "", n: int = 1) -> bool:
        """Count ``n`` occurrences of ``kind`` (always) and log them: a data fault as a warning once
        per (kind, tier) burst, the repeats inside the burst at debug level and summarised in the
        next warning. True when this call logged the warning (the first of a burst)."""
        EVENTS.labels(kind).inc(n)
        self._add(f"events.{kind}", n)
        level = logging.DEBUG if kind in self._QUIET else logging.WARNING
        if level == logging.WARNING:
            now, burst = time.monotonic(), (kind, tier)
            with self._lock:
                last = self._logged.get(burst)
                if last is not None and now - last[0] < self.LOG_BURST_S:
                    self._logged[burst] = (last[0], last[1] + n)
                    level = logging.DEBUG
                else:
                    held = last[1] if last is not None else 0
                    self._logged[burst] = (now, n - 1)
            if level == logging.WARNING and held:
                detail = f"{detail} (+{held} more since the last warning)"
        log.log(level, "kvtier %s event on %s tier: %s", kind, tier or "store", detail)
        return level == logging.WARNING

    def burst_over(self, kind: str, tier: str) -> bool:
        """End the current burst of (kind, tier): its next occurrence logs again. True if one was open."""
        with self._lock:
            last = self._logged.get((kind, tier))
            if last is None or last[0] == float("-inf"):
                return False
            self._logged[(kind, tier)] = (float("-inf"), last[1])   # the held-back count still goes in the next line
            return True

    def hit(self, tier: str, nbytes: int, seconds: float) -> None:
        STORE_HITS.labels(tier).inc()
        BYTES_READ.labels(tier).inc(nbytes)
        GET_SECONDS.labels(tier).observe(seconds)
        self._add(f"hits.{tier}")
        self._add(f"bytes_read.{tier}", nbytes)

    def miss(self, tier: str) -> None:
        STORE_MISSES.labels(tier).inc()
        self._add(f"misses.{tier}")

    def wrote(self, tier: str, nbytes: int, seconds: float) -> None:
        BYTES_WRITTEN.labels(tier).inc(nbytes)
        PUT_SECONDS.labels(tier).observe(seconds)
        self._add(f"puts.{tier}")
        self._add(f"bytes_written.{tier}", nbytes)

    def evicted(self, tier: str, n: int = 1) -> None:
        EVICTIONS.labels(tier).inc(n)
        self._add(f"evictions.{tier}", n)

    def lookup(self, asked: int, found: int) -> None:
        STORE_LOOKUPS.inc()
        STORE_LOOKUP_CHUNKS.labels("hit").inc(found)
        STORE_LOOKUP_CHUNKS.labels("miss").inc(asked - found)
        self._add("lookups")
        self._add("lookup_chunks.hit", found)
        self._add("lookup_chunks.miss", asked - found)

    def usage(self, tier: str, used: int, capacity: int) -> None:
        USAGE_BYTES.labels(tier).set(used)
        CAPACITY_BYTES.labels(tier).set(capacity)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def now() -> float:
    return time.perf_counter()
