"""Whether the shared filesystem answers: the mount's state as the shared-filesystem tier sees it.

``OK``: reads and writes. ``READ_ONLY`` (EROFS, EACCES, EPERM on a mount whose ``chunks/`` exists):
reads only, writes dropped. ``DOWN`` (missing mount, ENOTCONN, EIO...): no I/O at all, reads and
lookups UNAVAILABLE. ``probe`` checks the mount now (namespace dirs, a probe file written and
removed); ``os_error`` classifies an error met on the data path. Each change is counted and logged
once per burst (``Bursts``).
"""

from __future__ import annotations

import errno
import os

from kvtier.keys import Namespace
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.protocol import Status
from kvtier.tiers.sharedfs import io as sio
from kvtier.tiers.sharedfs.layout import DOWN_ERRNOS, HOST, Layout

OK, READ_ONLY, DOWN = "ok", "read_only", "down"


class Mount:
    """The state of the mount under ``layout`` (starts ``DOWN`` until the first ``probe``)."""

    def __init__(self, layout: Layout, namespace: Namespace, events: Bursts) -> None:
        self.layout = layout
        self.namespace = namespace
        self.events = events
        self.state = DOWN

    def probe(self) -> str:
        """Check the mount now (creates the namespace dirs, writes and removes a probe file)."""
        try:
            self.layout.ensure_root(self.namespace)
            sio.probe_write(f"{self.layout.tmp}/probe.{HOST}.{os.getpid()}.tmp")
            new = OK
        except OSError as e:
            new = READ_ONLY if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and \
                self.layout.chunks.is_dir() else DOWN
            detail = str(e)
        if new == OK and self.state != OK:
            self.events.resumed("shared_down", "shared filesystem answers again")
            self.events.resumed("read_only", "shared filesystem is writable again")
        elif new == DOWN:
            self.events.fault("shared_down", f"{self.layout.base}: {detail}")
        elif new == READ_ONLY:
            self.events.fault("read_only", f"{self.layout.base}: {detail}; reads only")
        self.state = new
        return new

    def os_error(self, e: OSError, what: str) -> Status:
        """Classify an OSError: a down mount (UNAVAILABLE) or a per-chunk fault (MISS)."""
        if e.errno in DOWN_ERRNOS:
            self.state = DOWN
            self.events.fault("shared_down", f"{what}: {e}")
            return Status.UNAVAILABLE
        self.events.fault("io_error", f"{what}: {e}")
        return Status.MISS
