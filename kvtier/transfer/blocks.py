"""``BlockCopier``: whole pages between vLLM's blocks and a host chunk buffer, ordered on streams.

A chunk payload is ``[num_layers, blocks_per_chunk, *page]`` (``views``). On a device, a save
gathers the chunk's pages of every layer into a device staging buffer (one ``index_select`` over the
``[L, B, page]`` view when one allocation holds every layer, else one per layer), then makes one
``non_blocking`` copy into a pinned host buffer; a load makes one copy of the host buffer into
device staging and one ``index_copy_`` into the blocks. On the CPU the gather writes straight into
the host buffer and the scatter reads straight from it: no staging, same calls otherwise.

Chunks stored per KV head (``head_views``): the copier gets one ``KVViews`` per KV head of the rank
(``slices``) and its buffers are head-major, ``[heads, num_layers, blocks_per_chunk, *head page]``: head
``s``'s payload is one contiguous slice of the buffer; each copy is then one gather or scatter per head.

Each copier is one *lane*: its own transfer stream and staging, so two lanes used from two threads
(the engine's loads, the background loader) never share a staging buffer. The ordering rules are the
ones in ``streams``; a copier's methods say which thread may call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvtier.transfer.host_buffers import HostBuffer
from kvtier.transfer.streams import Event, Streams, streams_for
from kvtier.transfer.views import KVViews

if TYPE_CHECKING:
    import torch


class BlockCopier:
    def __init__(self, views: KVViews, blocks_per_chunk: int, streams: Streams | None = None,
                 slices: Sequence[KVViews] | None = None) -> None:
        self.views = views
        self.slices = list(slices) if slices else []     # per KV head: a head-major buffer
        self.blocks_per_chunk = blocks_per_chunk
        self.streams = streams if streams is not None else streams_for(views.device)
        self.stream = self.streams.new_stream()
        self.on_host = views.device.type == "cpu"
        self._staging: "torch.Tensor | None" = None
        self.last: Event | None = None          # the event after this lane's last copy

    # -- buffers -----------------------------------------------------------------------------
    def new_buffer(self) -> HostBuffer:
        """A host chunk buffer (pinned for a device)."""
        return HostBuffer(self.chunk_shape(), self.views.dtype, pin=not self.on_host)

    def chunk_shape(self) -> tuple[int, ...]:
        """A chunk buffer's shape: ``views.chunk_shape``, head-major with head slices."""
        if self.slices:
            return (len(self.slices), *self.slices[0].chunk_shape(self.blocks_per_chunk))
        return self.views.chunk_shape(self.blocks_per_chunk)

    def _parts(self, buffer: "torch.Tensor") -> list[tuple[KVViews, "torch.Tensor"]]:
        """(views, ``[L, blocks_per_chunk, page words]`` of ``buffer``) per slice: the whole chunk, or each head."""
        if not self.slices:
            return [(self.views, self.views.buffer_pages(buffer))]
        return [(v, v.buffer_pages(buffer[s])) for s, v in enumerate(self.slices)]

    def _stage(self) -> "torch.Tensor":
        """Device staging: ``[slices, L, blocks_per_chunk, page words]``."""
        import torch

        if self._staging is None:
            vs = self.slices or [self.views]
            self._staging = torch.empty((len(vs), vs[0].num_layers, self.blocks_per_chunk, vs[0].page_words),
                                        dtype=vs[0].word, device=vs[0].device)
        return self._staging

    def _index(self, block_ids: Sequence[int]) -> tuple["torch.Tensor", Any]:
        """The block ids as an index on the device (uploaded without a host sync) and what must stay alive."""
        import torch

        host = torch.tensor(list(block_ids), dtype=torch.long)
        if self.on_host:
            return host, None
        host = host.pin_memory()
        return host.to(self.views.device, non_blocking=True), host

    # -- ordering (streams rules 1-4) ----------------------------------------------------------
    def compute_mark(self) -> Event:
        """(engine thread) An event after everything queued so far on the compute stream."""
        return self.streams.record(self.streams.current())

    def follow(self, event: Event) -> None:
        """(any thread) This lane's next copies wait for ``event``."""
        self.streams.wait(self.stream, event)

    def follow_compute(self) -> None:
        """(engine thread) This lane's next copies wait for the compute stream's work so far."""
        self.follow(self.compute_mark())

    def record(self) -> Event:
        """(any thread) An event after this lane's copies so far."""
        ev = self.streams.record(self.stream)
        self.last = ev
        return ev

    def fence(self, event: Event | None) -> None:
        """(engine thread) The compute stream waits for ``event`` (a load it will read)."""
        if event is not None:
            self.streams.wait(self.streams.current(), event)

    # -- copies ------------------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int], buf: HostBuffer) -> Event:
        """Copy the pages of ``block_ids`` (a whole chunk) of every layer into ``buf``; the event after
        the copy is returned and marked on ``buf`` (read its bytes after ``buf.claim()``)."""
        import torch

        n = len(block_ids)
        with self.streams.on(self.stream):
            idx, keep = self._index(block_ids)
            for s, (v, pages) in enumerate(self._parts(buf.tensor)):
                out = pages[:, :n]
                dst = out if self.on_host else self._stage()[s, :, :n]
                if v.stacked is not None:
                    torch.index_select(v.stacked, 1, idx, out=dst)
                else:
                    for i, page in enumerate(v.pages):
                        torch.index_select(page, 0, idx, out=dst[i])
                if not self.on_host:
                    out.copy_(dst, non_blocking=True)
            ev = self.record()
        buf.mark(ev, keep)
        return ev

    def scatter(self, block_ids: Sequence[int], first_block: int, buf: HostBuffer,
                layers: range | None = None) -> Event:
        """Copy blocks ``first_block:`` of the chunk in ``buf`` into ``block_ids`` (of ``layers``, default
        all); returns the event after the copy (also marked on ``buf``). ``first_block`` skips leading
        blocks the engine already holds."""
        v = self.views
        n = len(block_ids)
        whole = layers is None or (layers.start == 0 and len(layers) == v.num_layers)
        sel = range(v.num_layers) if layers is None else layers
        with self.streams.on(self.stream):
            idx, keep = self._index(block_ids)
            for s, (sv, pages) in enumerate(self._parts(buf.tensor)):
                src = pages[:, first_block:first_block + n]
                if not self.on_host:
                    stage = self._stage()[s, :, :n]
                    stage[sel.start:sel.stop].copy_(src[sel.start:sel.stop], non_blocking=True)
                    src = stage
                if whole and sv.stacked is not None:
                    sv.stacked.index_copy_(1, idx, src)
                else:
                    for i in sel:
                        sv.pages[i].index_copy_(0, idx, src[i])
            ev = self.record()
        buf.mark(ev, keep)
        return ev
