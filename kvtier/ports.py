"""Free TCP ports on 127.0.0.1 for the servers kvtier starts (vLLM servers, local services, the
load balancer): one chooser for all of them.

A server binds its port seconds after the port is chosen (a vLLM engine after its imports), so a
port must stay free in between. ``free_port`` chooses *below* the kernel's ephemeral range: any
``bind(0)`` or outgoing ``connect()`` of another process (vLLM's own ZMQ and torch.distributed
ports, every client connection) takes ports from the ephemeral range only, never from below it;
and it never hands out a port twice in one process (thread-safe). Another process choosing the
same port is still possible: ``VllmServer.start`` then launches on another one.

Side-effect free at import.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

HOST = "127.0.0.1"

#: ports handed out by ``free_port`` in this process (chosen now, bound later by a server)
_HANDED_OUT: set[int] = set()
_LOCK = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``; Linux's default if unreadable)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def port_is_free(port: int) -> bool:
    """Whether ``HOST:port`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A TCP port p on 127.0.0.1 with p .. p + count - 1 free now and not handed out before by
    this process; below the ephemeral range, or kernel-chosen when no port there is free."""
    lo, _ = ephemeral_range()
    first = max(1024, lo - 12000)
    rng = random.SystemRandom()
    with _LOCK:
        for _ in range(400):
            p = rng.randrange(first, max(first + count, lo - count + 1))
            if _take(range(p, p + count)):
                return p
        for _ in range(50):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((HOST, 0))
                p = s.getsockname()[1]
            if p + count <= 65536 and _take(range(p, p + count)):
                return p
    raise OSError(f"no {count} consecutive free TCP ports on {HOST}")


def _take(span: range) -> bool:
    """(lock held) Hand out ``span`` if no port of it was handed out before and all are free."""
    if any(q in _HANDED_OUT for q in span) or not all(port_is_free(q) for q in span):
        return False
    _HANDED_OUT.update(span)
    return True
