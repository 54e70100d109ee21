"""Which replica a real HAProxy sends each conversation to in ``sticky`` mode.

``kvtier demo cluster``'s sticky routing is HAProxy's ``balance hdr(X-Conversation-Id)`` with
``hash-type consistent``: the conversation -> replica map depends on HAProxy's hash ring, not on a
hash the simulator can copy from the docs. So the validation asks HAProxy itself: the same config
(``kvtier.services.haproxy``, the demo's replica names in the demo's order) in front of N tiny HTTP
servers, one request per conversation id with its header, the replica read off the
``X-Kvtier-Replica`` response header. Needs the ``haproxy`` binary (``scripts/setup.sh``).

    assignment = haproxy_assignment(["c0", "c1", ...], replicas=2)   # {"c0": 1, "c1": 0, ...}
"""

from __future__ import annotations

import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence

import httpx

from kvtier.services.haproxy import CONVERSATION_HEADER, SERVED_BY_HEADER, Backend, Haproxy


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def haproxy_assignment(conversation_ids: Sequence[str], replicas: int, names: Sequence[str] | None = None,
                       ready_timeout_s: float = 15.0) -> dict[str, int]:
    """conversation id -> replica index, as HAProxy's sticky mode routes them (module docstring)."""
    names = list(names) if names is not None else [f"r{i}" for i in range(replicas)]
    if len(names) != replicas:
        raise ValueError(f"{len(names)} replica names for {replicas} replicas")
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Ok) for _ in range(replicas)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    index = {n: i for i, n in enumerate(names)}
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-haproxy-probe-") as tmp, \
                Haproxy.start(Path(tmp), "sticky", [Backend(n, s.server_address[1]) for n, s in zip(names, servers)],
                              check_interval_ms=200) as lb, httpx.Client(base_url=lb.url, timeout=5.0) as client:
            # every replica must pass its health check first, or HAProxy redispatches its share
            deadline = time.monotonic() + ready_timeout_s
            while True:
                seen = {client.get("/probe", headers={CONVERSATION_HEADER: f"probe-{i}"}).headers.get(SERVED_BY_HEADER)
                        for i in range(64)}
                if seen >= set(names) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if not seen >= set(names):
                raise RuntimeError(f"HAProxy never routed to {sorted(set(names) - seen)} within {ready_timeout_s} s")
            out = {}
            for c in conversation_ids:
                served = client.get("/", headers={CONVERSATION_HEADER: c}).headers.get(SERVED_BY_HEADER)
                if served not in index:
                    raise RuntimeError(f"HAProxy answered conversation {c!r} from unknown replica {served!r}")
                out[c] = index[served]
            return out
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
