"""The small typed values every tier speaks: deadlines, capabilities, and batched results.

This module is the contract between the store and *any* backend — RAM, local SSD, a
shared filesystem mount, Valkey/Redis, Mooncake Store, or a fault-injecting wrapper.
Every call that may touch a network or a disk is **batched** (one call per request,
not per chunk) and carries a ``Deadline``; every answer distinguishes

* ``HIT``          — the chunk is there (and for reads: verified bytes are in the buffer),
* ``MISS``         — the backend answered: it does not have it (or had only a bad copy),
* ``UNAVAILABLE``  — no answer: the backend is down, refused us, or the deadline passed.

A ``MISS`` is final for this request; ``UNAVAILABLE`` says nothing about the chunk and
feeds the tier's circuit breaker (see ``kvtier.tiers.breaker``). Neither ever raises:
only programming errors (a buffer too small, a closed tier) raise.

Side-effect free: nothing here does I/O.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Callable

from kvtier.chunk import ChunkMeta
from kvtier.keys import ChunkKey


class Status(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute point on the monotonic clock; ``Deadline.never()`` has no limit."""

    at: float

    @staticmethod
    def after(seconds: float) -> "Deadline":
        return Deadline(time.monotonic() + max(0.0, seconds))

    @staticmethod
    def never() -> "Deadline":
        return Deadline(math.inf)

    def remaining(self) -> float:
        """Seconds left (>= 0; ``math.inf`` for ``never()``)."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def cap(self, seconds: float) -> "Deadline":
        """The earlier of this deadline and ``seconds`` from now."""
        return Deadline(min(self.at, time.monotonic() + max(0.0, seconds)))


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a tier is, declared by the tier (the store never probes with ``getattr``).

    shared:          other machines read and write the same chunks (sharedfs, valkey, mooncake).
    evicts_itself:   the backend removes chunks on its own (server ``maxmemory``, Mooncake's master,
                     the shared-fs janitor): kvtier learns of it only by a miss; no ``on_evict`` reports.
    complete_index:  this process holds an index of every chunk the tier has, so ``longest_prefix``
                     is a memory-only lookup, cheap enough for the scheduler's loop. False for shared
                     tiers: their lookup is a (batched, deadline-bounded) round trip.
    local_budget:    the byte budget is enforced by this process/host (RAM, local SSD). False: the
                     budget belongs to the medium's owner (server, janitor) and no write takes a
                     cluster-wide lock.
    max_chunk_bytes: largest encoded chunk the backend accepts (None: no limit); the store refuses
                     larger chunks at start with a one-line error, never at run time.
    """

    shared: bool = False
    evicts_itself: bool = False
    complete_index: bool = True
    local_budget: bool = True
    max_chunk_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class PrefixResult:
    """Answer of ``longest_prefix``: the first ``num_chunks`` keys are present.

    ``status`` is HIT when ``num_chunks == len(keys)``, MISS when the tier answered and the
    chain stops at ``num_chunks``, UNAVAILABLE when the tier could not answer (in time):
    ``num_chunks`` is then what it knew for sure (often 0)."""

    num_chunks: int
    status: Status

    @property
    def answered(self) -> bool:
        return self.status is not Status.UNAVAILABLE


@dataclass(frozen=True, slots=True)
class ReadResult:
    """One key of a batched ``read_into``: on HIT, ``meta`` describes the verified payload now in
    the caller's buffer (``meta.payload_len`` bytes); otherwise the buffer's contents are
    unspecified and ``error`` names the counted event (absent, corrupt, torn, io, timeout, down, ...)."""

    status: Status
    meta: ChunkMeta | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.HIT

    @staticmethod
    def hit(meta: ChunkMeta) -> "ReadResult":
        return ReadResult(Status.HIT, meta)

    @staticmethod
    def miss(error: str = "absent") -> "ReadResult":
        return ReadResult(Status.MISS, None, error)

    @staticmethod
    def unavailable(error: str = "down") -> "ReadResult":
        return ReadResult(Status.UNAVAILABLE, None, error)


#: Called once per written key, from any thread, when the write is durable in the tier (True) or
#: has failed / was dropped (False). Must not block and must not raise.
WriteDone = Callable[[ChunkKey, bool], None]


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One chunk to write. ``payload`` must stay valid and unchanged until ``release`` is called
    (by the tier, exactly once, from any thread). ``release is None``: the tier copies the payload
    before ``write`` returns (the caller may reuse its buffer at once)."""

    meta: ChunkMeta
    payload: memoryview
    release: Callable[[], None] | None = None
