"""Where one synchronous load spent its time (the worker's ``load``): logged at debug level and
observed in ``kvtier_connector_load_phase_seconds{phase}``."""

from __future__ import annotations


class LoadTimes:
    """Where one ``load`` call spent its time (seconds); logged at debug level and observed in
    ``kvtier_connector_load_phase_seconds{phase}``.

    read: file read + checksum verify (+ a sync promotion), summed over the reader threads;
    wait: the loading thread blocked on a read; copy: block copies into vLLM's KV cache."""

    __slots__ = ("read", "wait", "copy", "total", "chunks", "nbytes")

    def __init__(self) -> None:
        self.read = self.wait = self.copy = self.total = 0.0
        self.chunks = self.nbytes = 0

    def line(self) -> str:
        mbs = self.nbytes / self.total / 1e6 if self.total > 0 else 0.0
        return (f"{self.chunks} chunks {self.nbytes / 1e6:.1f} MB in {self.total * 1e3:.1f} ms ({mbs:.0f} MB/s): "
                f"read+verify {self.read * 1e3:.1f} ms (threads), waited {self.wait * 1e3:.1f} ms, "
                f"copy into blocks {self.copy * 1e3:.1f} ms")
