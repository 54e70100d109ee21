"""The connector's request log: append-only JSON lines (claim, load, save, finished events per
request) for tests and audits (``connector.request_log``)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kvtier.connector")


class RequestLog:
    """Append-only JSON lines (one event per line) for tests and audits; no-op without a path."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if self._path is None:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        with self._lock:
            try:
                with open(self._path, "a") as f:
                    f.write(line)
            except OSError as e:
                log.warning("kvtier: cannot write request log %s: %s", self._path, e)
