"""The Mooncake Store client of the mooncake tier: set-up in the background, deadlines, error codes.

``MooncakeDistributedStore.setup`` blocks while the master is unreachable (its own retries), so it
runs on a daemon thread that retries every ``probe_interval_s``; until it succeeds the tier answers
UNAVAILABLE at once. The client's RPC, connect and TCP-progress timeouts are taken from the tier's
config through Mooncake's environment variables (``MC_RPC_TIMEOUT_MS`` ...; values already in the
environment win), set once before the first set-up. After a master restart the client reconnects
by itself.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

from kvtier.config import ConfigError, MooncakeConfig

log = logging.getLogger("kvtier.mooncake")

# Mooncake's ErrorCode values (mooncake-store/include/types.h) the tier tells apart.
NO_AVAILABLE_HANDLE = -200     # the pool has no space left for the object
INVALID_PARAMS = -600          # e.g. a buffer of the wrong size
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901


def fault_kind(rc: int) -> str:
    """Counted event name for a negative return code."""
    if rc == NO_AVAILABLE_HANDLE:
        return "full"
    if rc == RPC_TIMEOUT:
        return "timeout"
    if rc in (RPC_FAIL, -1) or -1000 < rc <= -900:
        return "down"
    if rc == TRANSFER_FAIL:
        return "transfer_failed"
    return f"error{rc}"


def import_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ConfigError("store.shared.kind=mooncake needs the Mooncake client: pip install "
                          f"'kvtier[services]' (mooncake-transfer-engine-non-cuda) ({exc})") from None
    return MooncakeDistributedStore, ReplicateConfig


def apply_timeouts(cfg: MooncakeConfig) -> None:
    """Mooncake reads its timeouts from the environment; derive them from ours unless set."""
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(int(cfg.io_timeout_s * 1000)))
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(int(max(cfg.lookup_timeout_s, 0.2) * 1000)))
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(cfg.io_timeout_s))))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


class Client:
    """Holds the store once set up; ``store`` is None until then. Thread-safe."""

    def __init__(self, cfg: MooncakeConfig) -> None:
        self.cfg = cfg
        self.store: Any = None
        self.replicate: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.first_error: str | None = None
        self.attempts = 0

    def start(self, wait_s: float) -> None:
        """Start the set-up thread and wait up to ``wait_s`` for the first attempt."""
        cls, rep_cls = import_store()
        apply_timeouts(self.cfg)
        rep = rep_cls()
        rep.replica_num = self.cfg.replicas
        self.replicate = rep
        first = threading.Event()
        self._thread = threading.Thread(target=self._connect, args=(cls, first), name="kvtier-mooncake-setup",
                                        daemon=True)
        self._thread.start()
        first.wait(wait_s)

    def _connect(self, cls: Any, first: threading.Event) -> None:
        c = self.cfg
        while not self._stop.is_set():
            self.attempts += 1
            store = cls()
            try:
                rc = store.setup(c.local_hostname, c.metadata_server, c.segment_bytes, c.local_buffer_bytes,
                                 c.protocol, c.rdma_devices, c.master)
            except Exception as exc:  # pybind errors (bad address...) are not retried forever silently
                rc = -1
                self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"
            if rc == 0:
                self.store = store
                first.set()
                if self.attempts > 1:
                    log.warning("kvtier mooncake tier: connected to master %s after %d attempts", c.master,
                                self.attempts)
                return
            if self.attempts == 1:
                self.first_error = self.first_error or f"setup returned {rc}"
                log.warning("kvtier mooncake tier: master %s not reachable (%s); answering 'unavailable' and "
                            "retrying every %.1fs", c.master, self.first_error, c.probe_interval_s)
            first.set()
            try:
                store.close()
            except Exception:
                pass
            self._stop.wait(c.probe_interval_s)

    def close(self) -> None:
        self._stop.set()
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except Exception:
                pass
