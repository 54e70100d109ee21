"""``ChunkTransfers``: the bytes of store and load jobs between vLLM's primary tier and kvtier's store.

The primary tier is one memory region of ``num_chunks`` rows of ``chunk_bytes`` (vLLM's
``SharedOffloadRegion``, seen as a memoryview); chunk ``c`` is row ``c``. A store job copies rows
into kvtier's store, each as one verified chunk (kvtier's chunk format: header with namespace and
key, checksum or MAC) whose payload is the row's bytes, exactly; a load job reads chunks back into
the rows it was given. Both run on a job thread, never on the scheduler's.

Contracts:

* store: a chunk the local tiers already hold is not written again; a row is handed to
  ``TieredStore.put``, which copies it before returning, so the primary slot may be reused as soon
  as the job is reported. The job succeeds when every chunk is held or accepted by some tier
  (kvtier's writes are bounded queues: a full one drops the write, counted).
* load: one batched ``read_into`` under a deadline (``load_timeout_s``; a shared tier's reads are
  capped by its ``io_timeout_s`` and its breaker), never lent, so no byte lands in a row after the
  job returned. A key is loaded only if the chunk verified and its payload is exactly one row:
  anything else (a miss, corruption, a wrong key, a timeout, a chunk of another size) fails that
  key; the job reports the keys that did load (vLLM keeps those and recomputes the rest).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from kvtier.integrations.vllm_tiering.jobs import JobOutcome
from kvtier.integrations.vllm_tiering.keymap import KeyMap
from kvtier.store import TieredStore
from kvtier.tiers.protocol import Deadline

PAYLOAD_DTYPE = "uint8"


class ChunkTransfers:
    def __init__(self, store: TieredStore, keymap: KeyMap, primary: memoryview, chunk_bytes: int,
                 chunk_tokens: int, load_timeout_s: float) -> None:
        flat = primary.cast("B") if (primary.format != "B" or primary.ndim != 1) else primary
        if chunk_bytes <= 0 or len(flat) % chunk_bytes:
            raise ValueError(f"primary region of {len(flat)} bytes is not a whole number of "
                             f"{chunk_bytes}-byte chunks")
        self.store = store
        self.keymap = keymap
        self._flat = flat
        self.chunk_bytes = chunk_bytes
        self.num_chunks = len(flat) // chunk_bytes
        self.chunk_tokens = chunk_tokens
        self.load_timeout_s = load_timeout_s

    def release(self) -> None:
        """Drop this object's view of the primary region (vLLM closes the region after its tiers)."""
        self._flat.release()

    def row(self, chunk_id: int) -> memoryview:
        """Primary chunk ``chunk_id``'s bytes (IndexError outside the region)."""
        c = int(chunk_id)
        if not 0 <= c < self.num_chunks:
            raise IndexError(f"primary chunk {c} outside [0, {self.num_chunks})")
        return self._flat[c * self.chunk_bytes:(c + 1) * self.chunk_bytes]

    def store_rows(self, keys: Sequence[bytes], chunk_ids: np.ndarray) -> JobOutcome:
        """Copy rows ``chunk_ids`` into kvtier's store under ``keys``."""
        if len(keys) != len(chunk_ids):
            raise ValueError(f"{len(keys)} keys for {len(chunk_ids)} primary chunks")
        t0 = time.monotonic()
        stored = 0
        ok = True
        for key, cid in zip(keys, chunk_ids):
            ck = self.keymap.stored_key(key)
            if self.store.where(ck) is not None:
                continue
            if self.store.put(ck, None, self.row(cid), num_tokens=self.chunk_tokens,
                              shape=(self.chunk_bytes,), dtype=PAYLOAD_DTYPE):
                stored += 1
            else:
                ok = False
        return JobOutcome(ok, transfer_bytes=stored * self.chunk_bytes, transfer_time=time.monotonic() - t0)

    def load_rows(self, keys: Sequence[bytes], chunk_ids: np.ndarray) -> JobOutcome:
        """Read ``keys`` into rows ``chunk_ids``; the keys that loaded verified, exact bytes."""
        if len(keys) != len(chunk_ids):
            raise ValueError(f"{len(keys)} keys for {len(chunk_ids)} primary chunks")
        t0 = time.monotonic()
        cks = self.keymap.chunk_keys(keys)
        outs = [self.row(c) for c in chunk_ids]
        results = self.store.read_into(cks, outs, Deadline.after(self.load_timeout_s), lent=False)
        good = tuple(k for k, r in zip(keys, results)
                     if r.ok and r.meta is not None and r.meta.payload_len == self.chunk_bytes)
        n = len(good)
        return JobOutcome(n == len(keys), None if n == len(keys) else good,
                          transfer_bytes=n * self.chunk_bytes, transfer_time=time.monotonic() - t0)
