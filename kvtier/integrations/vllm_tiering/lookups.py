"""``SharedLookups``: existence checks on kvtier's shared tier off the scheduler thread.

vLLM's ``AsyncLookupManager`` (the same one its ``fs`` tier uses) collects the keys looked up in a
scheduler step, answers None (the tier says RETRY) until a background thread has checked them, and
keeps each verdict while a request refers to the key. Here the check is kvtier's: batched,
deadline-bounded ``shared_prefix`` calls (the shared tier's ``lookup_timeout_s``, its breaker):
a tier that cannot answer in time makes the unanswered keys misses, so lookups keep answering while
a backend stalls. Keys are independent chunks (no chain): after the first absent key of a batch the
check resumes past it, so one call answers a batch of hits and each miss costs one more call.
"""

from __future__ import annotations

from typing import Iterable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvtier.integrations.vllm_tiering.keymap import KeyMap
from kvtier.store import TieredStore
from kvtier.tiers.protocol import Deadline, Status


def shared_existence(store: TieredStore, keymap: KeyMap, keys: list[bytes], timeout_s: float) -> list[bool]:
    """Per key: whether the shared tier holds it (False where it could not answer in ``timeout_s``)."""
    cks = keymap.chunk_keys(keys)
    found = [False] * len(cks)
    deadline = Deadline.after(timeout_s)
    i = 0
    while i < len(cks) and not deadline.expired():
        res = store.shared_prefix(cks[i:], deadline)
        for j in range(i, i + res.num_chunks):
            found[j] = True
        i += res.num_chunks
        if res.status is Status.UNAVAILABLE:
            break
        i += 1                                   # keys[i] is absent: go on past it
    return found


class SharedLookups(AsyncLookupManager):
    def __init__(self, tier_type: str, store: TieredStore, keymap: KeyMap, timeout_s: float) -> None:
        self._store = store
        self._keymap = keymap
        self._timeout_s = timeout_s
        super().__init__(tier_type=tier_type)     # starts vLLM's lookup thread

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return shared_existence(self._store, self._keymap, list(keys), self._timeout_s)
