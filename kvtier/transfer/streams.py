"""The stream/event interface every KV transfer is ordered through.

An engine computes on its *compute* stream (vLLM: the current stream of the thread that runs the
forward pass); kvtier copies on *transfer* streams of its own, one per kind of copy (saves, loads,
layer-pipelined loads, background loads). The rules the connector keeps (``blocks.BlockCopier``):

1. A save's gather waits for the compute stream (the forward pass wrote those blocks).
2. A load's scatter waits for the compute stream's state when the load was planned (the blocks were
   allocated, and vLLM may zero new blocks, on the compute stream).
3. A layer-pipelined load records one event per layer; ``wait_for_layer_load`` makes the compute stream
   wait on that event (``fence``), never on a host-side flag alone.
4. A background (async) load is reported finished only when its last event has completed (``query``).
5. A host buffer is written again only after the event of its last copy completed (``HostBuffer``).

``NoStreams`` is the CPU: every operation runs when it is issued, so every event has completed and
every wait is a no-op; the same calls are made in the same places. ``CudaStreams`` is a CUDA device.
Tests drive the connector with a recording implementation and check the rules above.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Protocol


class Event(Protocol):
    def query(self) -> bool: ...          # the work before it has completed
    def synchronize(self) -> None: ...    # block the calling host thread until it has


class Streams(Protocol):
    def current(self) -> Any: ...                              # the calling thread's current (compute) stream
    def new_stream(self) -> Any: ...                           # a transfer stream
    def on(self, stream: Any) -> ContextManager[Any]: ...      # work issued inside runs on ``stream``
    def record(self, stream: Any) -> Event: ...                # a new event after the work queued on ``stream``
    def wait(self, stream: Any, event: Event) -> None: ...     # ``stream`` runs nothing more until ``event``


class DoneEvent:
    """An event whose work has completed (the CPU's every event)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


class NoStreams:
    """The CPU: work runs as it is issued."""

    device_type = "cpu"

    def current(self) -> Any:
        return None

    def new_stream(self) -> Any:
        return None

    def on(self, stream: Any) -> ContextManager[Any]:
        return nullcontext()

    def record(self, stream: Any) -> Event:
        return DONE

    def wait(self, stream: Any, event: Event) -> None:
        return None


class CudaStreams:
    """One CUDA device: real streams and events."""

    device_type = "cuda"

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        self._cuda = torch.cuda

    def current(self) -> Any:
        return self._cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return self._cuda.Stream(self.device)

    def on(self, stream: Any) -> ContextManager[Any]:
        return self._cuda.stream(stream)

    def record(self, stream: Any) -> Event:
        ev = self._cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)


class Ordering(Protocol):
    """The stream ordering a loader keeps (``blocks.BlockCopier`` provides it)."""

    def compute_mark(self) -> Any: ...          # engine thread: an event after the compute stream's work
    def follow(self, event: Any) -> None: ...   # the transfer stream waits for ``event``
    def follow_compute(self) -> None: ...       # engine thread: compute_mark + follow
    def record(self) -> Any: ...                # an event after the transfer stream's copies so far
    def fence(self, event: Any) -> None: ...    # engine thread: the compute stream waits for ``event``


class NoOrdering:
    """Copies that complete as they are issued (plain tensors, no streams)."""

    def compute_mark(self) -> Any:
        return None

    def follow(self, event: Any) -> None:
        return None

    def follow_compute(self) -> None:
        return None

    def record(self) -> Any:
        return None

    def fence(self, event: Any) -> None:
        return None


def streams_for(device: Any) -> Streams:
    """The streams of the device the KV cache lives on; ValueError for a device kvtier has no streams for."""
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        return NoStreams()
    if kind == "cuda":
        return CudaStreams(device)
    raise ValueError(f"kvtier has no transfer streams for device type {kind!r} (cpu and cuda are supported)")
