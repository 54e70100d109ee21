"""``HeadSplitStore``: the worker's store seen chunk by chunk while chunks are stored per KV head.

With ``connector.tp_layout: per-kv-head`` (``kv_heads.py``) the worker's chunk buffers are head-major:
``[count, num_layers, blocks_per_chunk, 1, block_size, content]`` for the ``count`` KV heads this rank
holds (``kvtier.transfer.blocks.BlockCopier`` with head slices), so head ``s`` of a buffer is one
contiguous slice of ``len / count`` bytes. This adapter gives the worker's save and load paths the
store interface they use for whole chunks and turns every call into the calls per head:

- ``put(key, parent, payload, shape=(count, *head_shape))``: one verified entry per head,
  ``head_key(key, h)`` with parent ``head_key(parent, h)``, ``head_shape``; True when every head's was
  accepted (a head refused leaves the chunk unclaimable: the scheduler needs every head).
- ``get_into`` / ``read_into``: every head into its slice, in one batched call for ``read_into``; a
  chunk is a HIT only when every one of its heads is (a head missing, corrupt, late or of another size
  fails the chunk, which the load paths count and vLLM recomputes), UNAVAILABLE when a head's tier did
  not answer. The meta of a HIT is a ``SplitMeta`` carrying every head's meta (for ``promote``).
- ``where``: the slowest local tier holding every head (None when a head is not local).

Everything else passes through. Thread-safe as the store is (no state of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

from kvtier.chunk import ChunkMeta
from kvtier.integrations.vllm.kv_heads import KvHeads, head_key
from kvtier.tiers.protocol import Deadline, ReadResult, Status


@dataclass(frozen=True)
class SplitMeta(ChunkMeta):
    """A chunk read head by head: ``payload_len`` is the heads' total, ``heads`` each head's own meta."""

    heads: tuple[ChunkMeta, ...] = ()


class HeadSplitStore:
    def __init__(self, inner: Any, heads: KvHeads) -> None:
        self.inner = inner
        self.heads = heads

    # -- helpers ---------------------------------------------------------------------------------
    def _slices(self, out: Any) -> list[memoryview]:
        view = memoryview(out).cast("B") if not isinstance(out, memoryview) or out.format != "B" else out
        n = self.heads.count
        if n < 1 or len(view) % n:
            raise ValueError(f"a chunk buffer of {len(view)} bytes does not split into {n} KV heads")
        step = len(view) // n
        return [view[s * step:(s + 1) * step] for s in range(n)]

    def _combine(self, key: Any, results: Sequence[ReadResult]) -> ReadResult:
        if all(r.status is Status.HIT for r in results):
            metas = tuple(r.meta for r in results)   # type: ignore[misc]
            first = metas[0]
            return ReadResult.hit(SplitMeta(key, first.parent, first.num_tokens, (len(metas), *first.shape),
                                            first.dtype, sum(m.payload_len for m in metas), metas))
        bad = next(r for r in results if r.status is not Status.HIT)
        status = Status.UNAVAILABLE if any(r.status is Status.UNAVAILABLE for r in results) else bad.status
        return ReadResult(status, None, bad.error)

    # -- the worker's store interface -------------------------------------------------------------
    def put(self, key: Any, parent: Any, payload: Any, *, num_tokens: int, shape: tuple[int, ...],
            dtype: str) -> bool:
        if not shape or shape[0] != self.heads.count:
            raise ValueError(f"a chunk of shape {tuple(shape)} is not {self.heads.count} KV heads")
        ok = True
        for h, part in zip(self.heads.local, self._slices(payload)):
            ok = self.inner.put(head_key(key, h), None if parent is None else head_key(parent, h), part,
                                num_tokens=num_tokens, shape=tuple(shape[1:]), dtype=dtype) and ok
        return ok

    def get_into(self, key: Any, out: Any, *, promote: bool | None = None, deadline: Deadline | None = None,
                 local_only: bool = False) -> int | None:
        total = 0
        for h, part in zip(self.heads.local, self._slices(out)):
            n = self.inner.get_into(head_key(key, h), part, promote=promote, deadline=deadline,
                                    local_only=local_only)
            if n is None or n != len(part):
                return None
            total += n
        return total

    def read_into(self, keys: Sequence[Any], outs: Sequence[Any], deadline: Deadline | None = None, *,
                  promote: bool | None = None, local_only: bool = False, lent: bool = False) -> list[ReadResult]:
        hkeys, houts = [], []
        for key, out in zip(keys, outs):
            hkeys += self.heads.keys(key)
            houts += self._slices(out)
        got = self.inner.read_into(hkeys, houts, deadline, promote=promote, local_only=local_only, lent=lent)
        n = self.heads.count
        res = []
        for i, key in enumerate(keys):
            part = got[i * n:(i + 1) * n]
            sized = [r if r.status is not Status.HIT or r.meta.payload_len == len(houts[i * n + j])
                     else ReadResult(Status.MISS, None, "size") for j, r in enumerate(part)]
            res.append(self._combine(key, sized))
        return res

    def promote(self, meta: Any, payload: Any) -> None:
        if not isinstance(meta, SplitMeta):
            raise TypeError("a chunk stored per KV head is promoted with the SplitMeta its read returned")
        for m, part in zip(meta.heads, self._slices(payload)):
            self.inner.promote(m, part)

    def where(self, key: Any) -> str | None:
        names = [self.inner.where(k) for k in self.heads.keys(key)]
        if not names or None in names:
            return None
        order = [t.name for t in getattr(self.inner, "local", [])]
        return max(names, key=lambda n: order.index(n) if n in order else len(order))

    def promote_later(self, keys: Sequence[Any], min_hits: int = 1) -> int:
        return self.inner.promote_later([k for key in keys for k in self.heads.keys(key)], min_hits)

    def prepare_memory(self, payload_len: int) -> bool:
        return self.inner.prepare_memory(payload_len // max(1, self.heads.count))

    def busy(self) -> ContextManager[None]:
        return self.inner.busy()

    def start_background_threads(self) -> None:
        self.inner.start_background_threads()

    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        return self.inner.subscribe(listener)

    def has_remote(self) -> bool:
        return bool(self.inner.has_remote())


__all__ = ["HeadSplitStore", "SplitMeta"]
