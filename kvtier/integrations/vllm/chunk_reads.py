"""``ChunkReads``: the worker's reads of one chunk from the store into a host buffer, timed per tier.

Both load paths read through it: synchronous loads from the local tiers only (``local``: a synchronous
load never waits on the network) and background loads top-down, the shared tier included (``any_tier``).
Every read is timed against the tier the store's index names before it (``shared`` when no local tier
holds the chunk) into ``ReadSpeeds``, which the scheduler's claim policy uses; a tier that did not answer
in time is marked unavailable. A read is good only when the store verified the chunk and it is exactly
``chunk_nbytes``; anything else is a miss with its kind (``miss``, ``size``, ``store_exception``). Buffers
are claimed before the read: a copy to the device of what they held may still be in flight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvtier.read_speed import ReadSpeeds
from kvtier.tiers.protocol import Deadline, Status
from kvtier.transfer.host_buffers import HostBuffer

log = logging.getLogger("kvtier.connector")


class ChunkReads:
    def __init__(self, store: Any, speeds: ReadSpeeds, *, promote_background: bool) -> None:
        self.store = store
        self.speeds = speeds
        self.promote_background = promote_background
        self.chunk_nbytes = 0                     # set when the worker registered vLLM's KV caches

    def local(self, key: bytes, buf: HostBuffer) -> tuple[bool, str | None]:
        """(reader thread) Fill ``buf`` with chunk ``key`` from the local tiers; (ok, error kind)."""
        promote = False if self.promote_background else None
        tier = self.store.where(key)
        t0 = time.perf_counter()
        try:
            n = self.store.get_into(key, buf.claim().bytes(), promote=promote, local_only=True)
        except Exception as e:  # a broken tier is a miss
            log.warning("kvtier: get failed: %s", e)
            return False, "store_exception"
        if n is None:
            return False, "miss"
        if n != self.chunk_nbytes:
            return False, "size"
        if tier is not None:
            self.speeds.record(tier, n, time.perf_counter() - t0)
        return True, None

    def any_tier(self, key: bytes, buf: HostBuffer, deadline: float) -> tuple[bool, str | None, Any]:
        """(reader thread) Read ``key`` top-down into ``buf``; (ok, error kind, the meta to promote when it
        came from the shared tier: the background loader promotes in request order, after the block copy)."""
        tier = self.store.where(key)
        t0 = time.perf_counter()
        try:
            res = self.store.read_into([key], [buf.claim().bytes()], Deadline(deadline), promote=False,
                                       lent=True)[0]   # the loader drops its ring after a failed read
        except Exception as e:  # a broken tier is a miss
            log.warning("kvtier: get failed: %s", e)
            return False, "store_exception", None
        meta = res.meta if res.status is Status.HIT else None
        if meta is None:
            if res.status is Status.UNAVAILABLE:
                self.speeds.failed(tier or "shared")
            return False, "miss", None
        if meta.payload_len != self.chunk_nbytes:
            return False, "size", None
        self.speeds.record(tier or "shared", meta.payload_len, time.perf_counter() - t0)
        return True, None, None if tier is not None else meta


__all__ = ["ChunkReads"]
