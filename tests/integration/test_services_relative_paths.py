"""Services and results folders started from relative paths, as a user runs the README's commands from a
checkout's root (tests elsewhere use absolute temporary directories): every path a service hands out or
compares is absolute, so a JuiceFS mount is seen ready, and HAProxy and Valkey find their files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.demo.common import results_dir
from kvtier.services.haproxy import Backend, Haproxy
from kvtier.services.juicefs import JuiceFs
from kvtier.services.valkey_server import ValkeyServer
from tests.services.fixtures import started

pytestmark = pytest.mark.integration


def test_juicefs_mounts_from_a_relative_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    meta = started(lambda: ValkeyServer.start(Path("shared"), password="s", policy="noeviction", name="meta"))
    fs = None
    try:
        assert meta.root.is_absolute()
        fs = started(lambda: JuiceFs.start(Path("shared"), meta))
        m = fs.mount("r0", timeout=20)          # a relative mount point was never seen ready (60 s, then an error)
        assert m.path.is_absolute() and m.cache_dir.is_absolute() and m.mounted()
        (m.path / "x").write_bytes(b"kv")
        other = fs.mount("r1", timeout=20)
        assert (other.path / "x").read_bytes() == b"kv"
    finally:
        if fs is not None:
            fs.stop()
        meta.stop()
    assert not m.mounted() and not other.mounted()


def test_haproxy_and_results_folders_from_relative_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder = results_dir(None, "demo-cluster")
    assert folder.is_absolute() and folder.parent == tmp_path / "results"
    assert results_dir(Path("out/run"), "x") == tmp_path / "out" / "run"
    lb = Haproxy.start(Path("lb"), "roundrobin", [Backend("r0", 9)])
    try:
        assert lb.config_path.is_absolute() and lb.log.is_absolute()
    finally:
        lb.stop()
