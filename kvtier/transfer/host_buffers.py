"""Chunk buffers in host memory, each remembering the event of its last device copy.

A store reads a chunk into a host buffer and the copier copies it to the device without waiting
(pinned memory makes ``non_blocking`` copies asynchronous); a save copies device blocks into a
host buffer the same way. So a buffer may still be the source or target of a copy in flight when
the host wants it again: ``claim()`` waits for the event of its last copy first (rule 5 of
``streams``). Pinned only for a device (pinning on a CPU engine would cost memory for nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.transfer.streams import DONE, Event

if TYPE_CHECKING:
    import torch


class HostBuffer:
    """One chunk's payload ``[num_layers, blocks_per_chunk, *page]`` in host memory."""

    def __init__(self, shape: tuple[int, ...], dtype: "torch.dtype", pin: bool) -> None:
        import torch

        self.tensor = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
        self.pinned = pin
        self.event: Event = DONE
        self.keep: Any = None          # what a copy in flight reads from (an index), kept alive until it ends

    def mark(self, event: Event, keep: Any = None) -> None:
        """``event`` follows the last copy into or out of this buffer."""
        self.event, self.keep = event, keep

    def claim(self) -> "HostBuffer":
        """Wait until no copy uses this buffer any more; returns it, free to be written by the host."""
        self.event.synchronize()
        self.event, self.keep = DONE, None
        return self

    def busy(self) -> bool:
        return not self.event.query()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def bytes(self) -> memoryview:
        """The payload bytes (for the store's reads and puts); claim the buffer first."""
        import torch

        return memoryview(self.tensor.view(torch.uint8).numpy()).cast("B")
