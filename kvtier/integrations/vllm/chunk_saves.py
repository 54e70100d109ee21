"""The worker's save path: fully computed chunks out of vLLM's paged KV blocks into the store.

Contract:
- ``save`` (from ``wait_for_save``) gathers each planned chunk into a host buffer of the save lane
  (``kvtier.transfer.blocks.BlockCopier``: after the compute stream's work so far, since the forward
  pass wrote those blocks; on a device the next chunk's gather runs while this one is put) and hands
  it to ``store.put``, which copies it before returning and writes the tiers in the background.
  Chunks of requests whose load failed in this step are skipped (their freshly computed KV would
  rest on the failed blocks). A ``put`` that raises is a failed save, logged and counted.
- When ``save`` returns, nothing references vLLM's blocks, so the step's ``releases`` (finished
  requests whose blocks vLLM kept for these saves) are returned by the next ``take_released``
  (finished_sending), whatever became of the saves, also with no target (connector disabled).
- Per request, what was saved (chunks, bytes, of them generated tokens', failures) is returned once
  by ``take_saved`` (the worker metadata's ``saves``) and counted in the metrics; with
  ``shared_writes`` every accepted save is reported as queued for the shared tier
  (``TierReports.shared_stored``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, SaveOutcome
from kvtier.integrations.vllm.reports import TierReports
from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.host_buffers import HostBuffer

if TYPE_CHECKING:
    from kvtier.integrations.vllm.metrics import ConnectorMetrics

log = logging.getLogger("kvtier.connector")


class PutStore(Protocol):
    """What the save path needs of the store."""

    def put(self, key: Any, parent: Any, payload: Any, *, num_tokens: int, shape: tuple[int, ...],
            dtype: str) -> bool: ...


@dataclass(frozen=True)
class SaveTarget:
    """The save lane over vLLM's registered KV layers and its host buffers (used in turn)."""

    copier: BlockCopier
    buffers: list[HostBuffer]
    shape: tuple[int, ...]
    dtype_name: str
    chunk_nbytes: int


class ChunkSaves:
    """Saves of one worker, their outcomes per request and the requests released."""

    def __init__(self, store: PutStore, reports: TierReports, *, chunk_size: int,
                 shared_writes: bool, metrics: "ConnectorMetrics | None") -> None:
        self.store = store
        self.reports = reports
        self.chunk_size = chunk_size
        self.shared_writes = shared_writes
        self.metrics = metrics
        self._saved: dict[str, SaveOutcome] = {}    # this step's saves per request (reported once)
        self._released: set[str] = set()             # finished requests whose blocks vLLM may free now

    def save(self, meta: KvtierConnectorMetadata, target: SaveTarget | None, skip: set[str]) -> None:
        """Save ``meta.saves`` into the store (none without a ``target``), but those of requests in ``skip``."""
        try:
            if meta.saves and target is not None:
                self._save(meta, target, skip)
        finally:   # the blocks of these finished requests are not referenced any more
            self._released.update(meta.releases)

    def _save(self, meta: KvtierConnectorMetadata, target: SaveTarget, skip: set[str]) -> None:
        chunks = [ch for ch in meta.saves if ch.req_id not in skip]
        if not chunks:
            return
        copier, bufs = target.copier, target.buffers
        started: dict[int, float] = {}
        gathered: dict[int, Exception | None] = {}

        def gather(j: int) -> None:     # chunk j's pages into its buffer, once the buffer's last copy ended
            if j < len(chunks):
                started[j] = time.perf_counter()
                try:
                    copier.gather(chunks[j].block_ids, bufs[j % len(bufs)].claim())
                    gathered[j] = None
                except Exception as e:
                    gathered[j] = e

        copier.follow_compute()         # the forward pass wrote these blocks on the compute stream
        gather(0)
        for j, ch in enumerate(chunks):
            gather(j + 1)               # runs on the device while chunk j is put
            try:
                if gathered[j] is not None:
                    raise gathered[j]   # type: ignore[misc]
                ok = self.store.put(ch.key, ch.parent, bufs[j % len(bufs)].claim().bytes(),
                                    num_tokens=self.chunk_size, shape=target.shape, dtype=target.dtype_name)
            except Exception as e:
                log.warning("kvtier: saving a chunk failed: %s", e)
                ok = False
                if self.metrics:
                    self.metrics.error("store_exception")
            if ok and self.shared_writes:
                self.reports.shared_stored([ch.key])    # queued for the shared tier by this replica
            n = target.chunk_nbytes if ok else 0
            done = SaveOutcome(int(ok), n, int(ok and ch.generated), n if ch.generated else 0, int(not ok))
            prev = self._saved.get(ch.req_id)
            self._saved[ch.req_id] = prev.add(done) if prev is not None else done
            if self.metrics:
                self.metrics.stored(n, time.perf_counter() - started[j], dropped=not ok, generated=ch.generated)

    def take_saved(self) -> dict[str, SaveOutcome]:
        """What was saved per request since the last call."""
        out, self._saved = self._saved, {}
        return out

    def take_released(self) -> set[str]:
        """Finished requests whose last saves were copied out of their blocks (finished_sending)."""
        out, self._released = self._released, set()
        return out
