"""Smoke tests of the real test services (tests/services): each starts, answers, stops cleanly.

Cheap (no vLLM); they run real binaries, hence ``integration``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.services.fixtures import juicefs, mooncake, valkey_cluster, valkey_password_server, valkey_server  # noqa: F401
from kvtier.services.juicefs import JuiceFs
from tests.services.mooncake import MooncakeCluster
from kvtier.services.valkey_server import ValkeyCluster, ValkeyServer

pytestmark = pytest.mark.integration


def test_valkey_standalone_set_get_kill_restart(valkey_server: ValkeyServer):
    c = valkey_server.client()
    assert c.set("k", b"v") and c.get("k") == b"v"
    valkey_server.kill()
    assert not valkey_server.alive()
    valkey_server.restart()
    assert valkey_server.client().get("k") is None  # no persistence: restarted empty


def test_valkey_password_required(valkey_password_server: ValkeyServer):
    import valkey

    with pytest.raises(valkey.AuthenticationError):
        valkey.Valkey(host=valkey_password_server.host, port=valkey_password_server.port).ping()
    assert valkey_password_server.client().ping()
    assert valkey_password_server.password in valkey_password_server.url


def test_valkey_pause_stalls_then_resumes(valkey_server: ValkeyServer):
    import valkey

    c = valkey.Valkey(host=valkey_server.host, port=valkey_server.port, socket_timeout=0.3)
    valkey_server.pause()
    try:
        with pytest.raises(valkey.TimeoutError):
            c.ping()
    finally:
        valkey_server.resume()
    assert valkey_server.client().ping()


def test_valkey_cluster_spreads_slots(valkey_cluster: ValkeyCluster):
    from valkey.cluster import ClusterNode, ValkeyCluster as Client

    c = Client(startup_nodes=[ClusterNode(h, p) for h, p in valkey_cluster.startup_nodes])
    for i in range(30):
        c.set(f"key{i}", str(i))
    assert [c.get(f"key{i}") for i in range(30)] == [str(i).encode() for i in range(30)]
    sizes = [n.client().dbsize() for n in valkey_cluster.nodes]
    assert len(sizes) == 3 and all(s > 0 for s in sizes) and sum(sizes) == 30
    c.close()


def test_juicefs_two_mounts_share_files(juicefs: JuiceFs):
    a, b = juicefs.mount("a"), juicefs.mount("b")
    assert a.cache_dir != b.cache_dir and a.pid != b.pid
    (a.path / "x.bin").write_bytes(b"hello")
    deadline = time.monotonic() + 10
    while not (b.path / "x.bin").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (b.path / "x.bin").read_bytes() == b"hello"
    a.pause()
    a.resume()
    a.umount()
    assert not a.mounted() and b.mounted()


def test_mooncake_put_get_through_pool_owner(mooncake: MooncakeCluster):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", mooncake.metadata_url, 0, 16 * 2**20, "tcp", "", mooncake.master_addr) == 0
    try:
        src = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
        dst = np.zeros_like(src)
        assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        assert s.batch_put_from(["a"], [src.ctypes.data], [src.nbytes]) == [0]
        assert s.batch_is_exist(["a", "b"]) == [1, 0]
        assert s.batch_get_into(["a"], [dst.ctypes.data], [dst.nbytes]) == [src.nbytes]
        assert (dst == src).all()
        s.unregister_buffer(src.ctypes.data)
        s.unregister_buffer(dst.ctypes.data)
    finally:
        s.close()
