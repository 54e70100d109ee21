"""Cluster mode of the Valkey tier without servers: a batch spanning nodes sends one pipeline per node,
all nodes at once (not one after another), and a node that fails degrades only its own keys.

Parallelism is shown without timing: every node's pipeline waits on a ``threading.Barrier`` that only
opens when all nodes are in flight at the same time; run one after another, the barrier breaks and
every key would be unavailable. (Real-cluster tests: tests/integration/test_valkey_*.py.)
"""

from __future__ import annotations

import threading
from typing import Any


from kvtier.chunk import encode
from kvtier.config import ValkeyConfig
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, Status
from tests.services.chunks import NS, buffers, chain, items


NODES = 3


class _Pipe:
    def __init__(self, node: "_Node") -> None:
        self.node, self.ops = node, []

    def exists(self, k: bytes) -> None:
        self.ops.append(("exists", k))

    def getrange(self, k: bytes, start: int, end: int) -> None:
        self.ops.append(("getrange", k, start, end))

    def delete(self, k: bytes) -> None:
        self.ops.append(("delete", k))

    def execute(self, raise_on_error: bool = True) -> list:
        self.node.arrive()
        out = []
        for op, k, *rest in self.ops:
            v = self.node.data.get(k)
            if op == "exists":
                out.append(int(v is not None))
            elif op == "getrange":
                out.append(b"" if v is None else v[rest[0]:rest[1] + 1])
            else:
                out.append(int(self.node.data.pop(k, None) is not None))
        return out


class _Conn:
    """The pooled connection ``send_sets`` writes packed SETs to."""

    def __init__(self, node: "_Node") -> None:
        self.node, self.replies = node, []

    def send_packed_command(self, pieces: list, check_health: bool = False) -> None:
        self.node.arrive()
        cmds: list[list] = []
        for p in pieces:
            if isinstance(p, bytes) and p.startswith((b"*3\r\n$3\r\nSET\r\n", b"*5\r\n$3\r\nSET\r\n")):
                cmds.append([])
            cmds[-1].append(bytes(p))
        for c in cmds:
            raw = b"".join(c)
            _, _, rest = raw.partition(b"SET\r\n$")
            klen, _, rest = rest.partition(b"\r\n")
            key, rest = rest[:int(klen)], rest[int(klen) + 2:]
            vlen, _, rest = rest[1:].partition(b"\r\n")
            self.node.data[key] = rest[:int(vlen)]
            self.replies.append(b"OK")

    def read_response(self) -> Any:
        return self.replies.pop(0)

    def disconnect(self) -> None:
        pass


class _Pool:
    def __init__(self, node: "_Node") -> None:
        self.node = node

    def get_connection(self, name: str) -> _Conn:
        return _Conn(self.node)

    def release(self, conn: _Conn) -> None:
        pass


class _Node:
    def __init__(self, barrier: threading.Barrier, down: bool = False) -> None:
        self.data: dict[bytes, bytes] = {}
        self.barrier, self.down = barrier, down
        self.connection_pool = _Pool(self)
        self.threads: set[str] = set()

    def arrive(self) -> None:
        self.threads.add(threading.current_thread().name)
        if self.down:
            import valkey

            raise valkey.ConnectionError("node down")
        self.barrier.wait()   # opens only when every live node's pipeline is in flight at once

    def pipeline(self, transaction: bool = False) -> _Pipe:
        return _Pipe(self)


class _Conns:
    """Routes key i to node i % NODES (what the slot map does for hash-tagged keys)."""

    def __init__(self, nodes: list[_Node]) -> None:
        from kvtier.tiers.valkey.conn import Group

        self.nodes, self._group = nodes, Group

    def groups(self, which: str, keys) -> list:
        return [self._group(n, [i for i in range(len(keys)) if i % NODES == j], f"n{j}")
                for j, n in enumerate(self.nodes) if any(i % NODES == j for i in range(len(keys)))]

    def node_failed(self) -> None:
        pass

    def close(self) -> None:
        pass


def _tier(down: int | None = None):
    from kvtier.tiers.valkey import ValkeyTier

    live = NODES - (down is not None)
    barrier = threading.Barrier(live, timeout=10)
    nodes = [_Node(barrier, down=(j == down)) for j in range(NODES)]
    tm = Telemetry()
    cfg = ValkeyConfig(url="redis://127.0.0.1:1/0", cluster=True, lookup_timeout_s=20, io_timeout_s=20)
    tier = ValkeyTier(cfg, NS, tm, _Conns(nodes))
    tier._limits_known = True
    return tier, tm, nodes


def test_batch_spanning_nodes_runs_one_pipeline_per_node_in_parallel():
    tier, tm, nodes = _tier()
    try:
        chunks = chain(9, payload_len=4096)
        keys = [m.key for m, _ in chunks]
        assert tier.write(items(chunks)) == [True] * 9          # three SET pipelines at once
        assert [len(n.data) for n in nodes] == [3, 3, 3]
        assert tier.longest_prefix(keys, Deadline.after(20)).num_chunks == 9
        outs = buffers(chunks)
        res = tier.read_into(keys, outs, Deadline.after(20))
        assert [r.status for r in res] == [Status.HIT] * 9
        assert all(bytes(o) == p for o, (_, p) in zip(outs, chunks))
        assert len(set().union(*(n.threads for n in nodes))) == NODES   # one thread per node
        assert not any(k.startswith("events.") for k in tm.counts)
    finally:
        tier.close()


def test_a_node_down_fails_only_its_keys_counted():
    tier, tm, nodes = _tier(down=1)
    try:
        chunks = chain(9, payload_len=4096)
        keys = [m.key for m, _ in chunks]
        for i, (m, p) in enumerate(chunks):               # the data is there on the live nodes
            if i % NODES != 1:
                nodes[i % NODES].data[tier._rk(m.key)] = encode(NS.digest(), m, p)
        res = tier.read_into(keys, buffers(chunks), Deadline.after(20))
        assert [r.status for r in res] == [Status.UNAVAILABLE if i % NODES == 1 else Status.HIT for i in range(9)]
        p = tier.longest_prefix(keys, Deadline.after(20))
        assert (p.num_chunks, p.status) == (1, Status.UNAVAILABLE)   # key 1 lives on the dead node
        ok = tier.write(items(chunks))
        assert ok == [i % NODES != 1 for i in range(9)]
        assert tm.counts["events.down"] >= 1
    finally:
        tier.close()
