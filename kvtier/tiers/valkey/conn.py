"""Connections of the Valkey tier: clients with deadlines, routing of keys to nodes, and the
classification of client errors into counted fault kinds.

Two clients share nothing but the address: the *lookup* client's socket timeout is
``lookup_timeout_s`` (existence checks the scheduler waits on), the *io* client's is
``io_timeout_s`` (reads and writes). No client retries: a failure is reported at once and the
caller's circuit breaker decides when to try again; a broken connection is dropped by the pool and
the next call reconnects by itself.

In cluster mode keys are grouped by the node that owns their slot and each node gets one pipeline
(one round trip per node per batch); a dead node fails only its own keys. The slot map is refreshed
after a node error, at most once per ``probe_interval_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from kvtier.config import ConfigError, ValkeyConfig

log = logging.getLogger("kvtier.valkey")
#: the io client's socket reads (valkey-py's default is 64 KiB: ~180 reads, each a GIL hand-off,
#: per 11.8 MB chunk; standalone only, valkey-py's cluster client does not pass the option on)
IO_SOCKET_READ_SIZE = 1 << 20

try:  # the client library is optional: only a configured valkey tier needs it
    import valkey
    from valkey.backoff import NoBackoff
    from valkey.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the services extra
    valkey = None  # type: ignore[assignment]


class AuthFailed(Exception):
    """The server refused our credentials (wrong password / ACL): the tier disables itself."""


def require_client() -> None:
    if valkey is None:
        raise ConfigError("store.shared.kind=valkey needs the valkey client: pip install 'kvtier[services]'")


def fault_kind(exc: BaseException) -> str:
    """The counted event name for a client exception (never includes secrets)."""
    if valkey is None:
        return "error"
    if isinstance(exc, AuthFailed) or isinstance(exc, valkey.AuthenticationError):
        return "auth_failed"
    if isinstance(exc, (valkey.exceptions.ClusterDownError, valkey.exceptions.MasterDownError,
                        valkey.exceptions.TryAgainError, valkey.exceptions.BusyLoadingError)):
        return "down"
    if isinstance(exc, (valkey.exceptions.MovedError, valkey.exceptions.AskError,
                        valkey.exceptions.SlotNotCoveredError)):
        return "moved"
    if isinstance(exc, valkey.exceptions.OutOfMemoryError):
        return "full"
    if isinstance(exc, valkey.exceptions.NoPermissionError):
        return "auth_failed"
    if isinstance(exc, valkey.ResponseError):
        msg = str(exc)
        if msg.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return "auth_failed"
        if msg.startswith("OOM"):
            return "full"
        return "server_error"
    if isinstance(exc, valkey.TimeoutError):
        return "timeout"
    if isinstance(exc, (valkey.ConnectionError, OSError)):
        return "down"
    return "error"


def short(exc: BaseException) -> str:
    """One line naming the error (client messages carry no credentials)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


@dataclass(frozen=True)
class Group:
    """Keys (by position in the caller's batch) that one node serves."""

    client: Any
    index: list[int]
    node: str


class Connections:
    """The lookup and io clients of one tier (standalone or cluster). Thread-safe."""

    def __init__(self, cfg: ValkeyConfig) -> None:
        require_client()
        self.cfg = cfg
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._failed_at: dict[str, float] = {}
        self._last_refresh = 0.0
        self._stale = False

    def _kwargs(self, timeout: float) -> dict[str, Any]:
        c = self.cfg
        kw: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=min(timeout, c.lookup_timeout_s * 2),
                                  retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
                                  max_connections=c.max_inflight * 2)
        if c.username:
            kw["username"] = c.username
        if c.password is not None:
            kw["password"] = c.password.get_secret_value()
        if self._tls():
            # the rediss:// scheme selects the TLS connection class; verify the certificate and its host
            kw.update(ssl_cert_reqs="required", ssl_check_hostname=True)
            if c.tls_ca_file is not None:
                kw["ssl_ca_certs"] = str(c.tls_ca_file)
        return kw

    def _tls(self) -> bool:
        return self.cfg.tls or self.cfg.url.startswith(("rediss://", "valkeys://"))

    def _url(self) -> str:
        """The URL valkey-py understands: redis:// or rediss:// (TLS, also when ``tls`` is set)."""
        url = self.cfg.url
        for plain, tls in (("valkeys://", "rediss://"), ("valkey://", "redis://")):
            if url.startswith(plain):
                url = tls + url[len(plain):]
        if self._tls() and url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]
        return url

    def _build(self, which: str) -> Any:
        timeout = self.cfg.lookup_timeout_s if which == "lookup" else self.cfg.io_timeout_s
        kw = self._kwargs(timeout)
        url = self._url()
        if not self.cfg.cluster:
            if which == "io":   # multi-MiB values: fewer, larger socket reads (each one a GIL hand-off)
                kw["socket_read_size"] = IO_SOCKET_READ_SIZE
            return valkey.Valkey.from_url(url, **kw)
        from valkey.cluster import ValkeyCluster

        kw.pop("max_connections")
        return ValkeyCluster.from_url(url, cluster_error_retry_attempts=1, require_full_coverage=False,
                                      max_connections=self.cfg.max_inflight * 2, **kw)

    def client(self, which: str) -> Any:
        """The ``lookup`` or ``io`` client; built on first use (a cluster client discovers the slot map
        then: if every node is down this raises, and building is retried after ``probe_interval_s``)."""
        cl = self._clients.get(which)
        if cl is not None:
            if self._stale:
                self._refresh()
            return cl
        with self._lock:
            cl = self._clients.get(which)
            if cl is not None:
                return cl
            now = time.monotonic()
            failed = self._failed_at.get(which)
            if failed is not None and now - failed < self.cfg.probe_interval_s:
                raise valkey.ConnectionError("valkey not reachable (next try after probe_interval_s)")
            try:
                cl = self._build(which)
            except Exception:
                self._failed_at[which] = now
                raise
            self._failed_at.pop(which, None)
            self._clients[which] = cl
            return cl

    def _refresh(self) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._stale or now - self._last_refresh < self.cfg.probe_interval_s:
                return
            self._last_refresh = now
            self._stale = False
            clients = list(self._clients.values())
        for cl in clients:
            try:
                cl.nodes_manager.initialize()
            except Exception as exc:  # keep the old map; a later node error marks it stale again
                log.debug("valkey slot map refresh failed: %s", short(exc))

    def node_failed(self) -> None:
        """A node errored: refresh the cluster slot map on a later call (rate-limited)."""
        if self.cfg.cluster:
            self._stale = True

    def groups(self, which: str, keys: Sequence[bytes]) -> list[Group]:
        """Route ``keys`` to the nodes that own them (one group in standalone mode)."""
        cl = self.client(which)
        if not self.cfg.cluster:
            return [Group(cl, list(range(len(keys))), "standalone")]
        by_node: dict[str, Group] = {}
        for i, k in enumerate(keys):
            node = cl.get_node_from_key(k)
            g = by_node.get(node.name)
            if g is None:
                g = by_node[node.name] = Group(cl.get_valkey_connection(node), [], node.name)
            g.index.append(i)
        return list(by_node.values())

    def all_nodes(self, which: str) -> list[Any]:
        """One client per primary (standalone: the one server)."""
        cl = self.client(which)
        if not self.cfg.cluster:
            return [cl]
        return [cl.get_valkey_connection(n) for n in cl.get_primaries()]

    def close(self) -> None:
        with self._lock:
            for cl in self._clients.values():
                try:
                    cl.close()
                except Exception:
                    pass
            self._clients.clear()
