"""pytest fixtures for the real test services. Import the ones a test module needs:

    from tests.services.fixtures import valkey_server, valkey_cluster, juicefs, mooncake  # noqa: F401

Each fixture starts its service(s) on 127.0.0.1 under the test's tmp dir and stops them in teardown,
even after a failure. A missing binary FAILS the test with a one-line reason (never a skip: a skipped
backend test would hide that CI does not exercise the backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

from kvtier.services._proc import ServiceMissing
from kvtier.services.juicefs import JuiceFs
from tests.services.mooncake import MooncakeCluster
from kvtier.services.valkey_server import ValkeyCluster, ValkeyServer

T = TypeVar("T")


def started(factory: Callable[[], T]) -> T:
    """Run a service's ``start``; a missing binary becomes ``pytest.fail`` with its message."""
    try:
        return factory()
    except ServiceMissing as exc:
        pytest.fail(f"test service unavailable: {exc}", pytrace=False)


@pytest.fixture
def valkey_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    """Standalone Valkey, no password, no maxmemory."""
    srv = started(lambda: ValkeyServer.start(tmp_path))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def valkey_password_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    """Standalone Valkey with ``requirepass`` (password: ``srv.password``)."""
    srv = started(lambda: ValkeyServer.start(tmp_path, password="kvtier-test-secret"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def valkey_small_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    """Standalone Valkey with ``maxmemory 8mb`` and ``allkeys-lru`` (fills up quickly)."""
    srv = started(lambda: ValkeyServer.start(tmp_path, maxmemory="8mb", policy="allkeys-lru"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    """Three masters, all slots assigned, no replicas; a dead node leaves the others serving."""
    cl = started(lambda: ValkeyCluster.start(tmp_path, masters=3))
    try:
        yield cl
    finally:
        cl.stop()


@pytest.fixture
def juicefs(tmp_path: Path) -> Iterator[JuiceFs]:
    """A formatted JuiceFS volume (metadata: a password-protected ``noeviction`` Valkey; data: a local
    dir). Call ``juicefs.mount("a")`` / ``.mount("b")`` for two machines; all are unmounted at teardown."""
    meta = started(lambda: ValkeyServer.start(tmp_path, password="jfs-meta-secret", policy="noeviction",
                                              name="juicefs-meta"))
    fs = None
    try:
        fs = started(lambda: JuiceFs.start(tmp_path, meta))
        yield fs
    finally:
        if fs is not None:
            fs.stop()
        meta.stop()


@pytest.fixture
def mooncake(tmp_path: Path) -> Iterator[MooncakeCluster]:
    """``mooncake_master`` + a standalone pool owner with a 64 MiB segment, TCP."""
    mc = started(lambda: MooncakeCluster.start(tmp_path, segment_bytes=64 * 2**20))
    try:
        yield mc
    finally:
        mc.stop()
