"""A recording implementation of ``kvtier.transfer.streams.Streams`` for ordering tests on the CPU.

Every stream operation and every block copy goes into one log. Events do not complete on their own:
``synchronize`` completes one (the host waited for it), ``complete_all`` completes every event
recorded so far (the device caught up). ``violations`` reads the log against the ordering rules.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvtier.transfer.blocks import BlockCopier

COMPUTE = "compute"


@dataclass(eq=False)
class RecEvent:
    rec: "RecordingStreams"
    id: int
    stream: str
    complete: bool = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.rec.log.append(("sync", self.id))
        self.complete = True


@dataclass
class RecordingStreams:
    log: list[tuple] = field(default_factory=list)
    events: list[RecEvent] = field(default_factory=list)
    _streams: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def current(self) -> str:
        return COMPUTE            # only the engine's thread asks

    def new_stream(self) -> str:
        with self._lock:
            self._streams += 1
            return f"transfer{self._streams}"

    @contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        yield

    def record(self, stream: Any) -> RecEvent:
        with self._lock:
            ev = RecEvent(self, len(self.events), stream)
            self.events.append(ev)
            self.log.append(("record", stream, ev.id))
            return ev

    def wait(self, stream: Any, event: RecEvent) -> None:
        with self._lock:
            self.log.append(("wait", stream, event.id))

    # -- what the engine does, for the log ---------------------------------------------------
    def compute(self, what: str, *detail: Any) -> None:
        """The compute stream queued work (a forward pass, zeroing new blocks, attention on a layer)."""
        with self._lock:
            self.log.append(("compute", what, *detail))

    def complete_all(self) -> None:
        for ev in list(self.events):
            ev.complete = True


def record_copies(monkeypatch, rec: RecordingStreams) -> None:
    """Log every gather and scatter of every copier with the stream it runs on."""
    gather, scatter = BlockCopier.gather, BlockCopier.scatter

    def logged_gather(self, block_ids, buf):
        rec.log.append(("gather", self.stream, tuple(block_ids)))
        return gather(self, block_ids, buf)

    def logged_scatter(self, block_ids, first_block, buf, layers=None):
        sel = tuple(layers) if layers is not None else tuple(range(self.views.num_layers))
        rec.log.append(("scatter", self.stream, tuple(block_ids), sel))
        return scatter(self, block_ids, first_block, buf, layers)

    monkeypatch.setattr(BlockCopier, "gather", logged_gather)
    monkeypatch.setattr(BlockCopier, "scatter", logged_scatter)


def _stream_saw_compute(log: list[tuple], upto: int, stream: str, since: int) -> bool:
    """Before log position ``upto``, ``stream`` waited on an event recorded on the compute stream after
    log position ``since`` (the compute work the copy must follow)."""
    recorded_at = {e[2]: i for i, e in enumerate(log[:upto]) if e[0] == "record" and e[1] == COMPUTE}
    return any(e[0] == "wait" and e[1] == stream and recorded_at.get(e[2], -1) > since
               for e in log[since:upto])


def copies_after_compute(log: list[tuple], kind: str, work: str) -> list[str]:
    """Rules 1-2: every ``kind`` copy waits for the last ``work`` the compute stream queued before it."""
    bad = []
    for i, e in enumerate(log):
        if e[0] != kind:
            continue
        last = max((j for j, x in enumerate(log[:i]) if x[0] == "compute" and x[1] == work), default=-1)
        if last >= 0 and not _stream_saw_compute(log, i, e[1], last):
            bad.append(f"{kind} of blocks {e[2]} at {i} on {e[1]} without waiting for the {work} at {last}")
    return bad


def attention_after_its_layer(log: list[tuple]) -> list[str]:
    """Rule 3: attention on layer l runs after the compute stream waited on an event recorded on the
    transfer stream after the last scatter into layer l."""
    bad = []
    for i, e in enumerate(log):
        if e[:2] != ("compute", "attention"):
            continue
        layer = e[2]
        last = max((j for j, x in enumerate(log[:i]) if x[0] == "scatter" and layer in x[3]), default=-1)
        if last < 0:
            continue
        stream = log[last][1]
        after = {x[2] for x in log[last:i] if x[0] == "record" and x[1] == stream}
        if not any(x[0] == "wait" and x[1] == COMPUTE and x[2] in after for x in log[last:i]):
            bad.append(f"attention on layer {layer} at {i} without waiting for its scatter at {last}")
    return bad
