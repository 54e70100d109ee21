"""The shared backends ``kvtier bench encoding`` measures its stores on: a JuiceFS volume seen through two
mounts (the writing and the reading "machine") and a Valkey server, each either given (``--sharedfs DIR``
[``--sharedfs-read DIR``], ``--valkey URL``) or started here on 127.0.0.1 for the run and stopped after it
(``kvtier.services``: JuiceFS metadata in a Valkey server of its own, data in a local directory; the data
Valkey with ``maxmemory`` and ``allkeys-lru``). Services started here keep their files under ``root``,
which is removed once they are stopped and nothing is mounted under it (the reading mount's client cache
holds a copy of every chunk read)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Callable, Iterator

from kvtier.bench.shared_seed import SharedTarget


@contextlib.contextmanager
def store_targets(root: Path, valkey: str, sharedfs: Path | None, sharedfs_read: Path | None,
                  log: Callable[[str], None] = print) -> Iterator[list[SharedTarget]]:
    """[the sharedfs target, the valkey target]; services started here are stopped on exit."""
    stops: list[Callable[[], None]] = []
    try:
        if sharedfs is None:
            from kvtier.services.juicefs import JuiceFs
            from kvtier.services.valkey_server import ValkeyServer

            meta = ValkeyServer.start(root, policy="noeviction", name="juicefs-meta")
            stops.append(meta.stop)
            fs = JuiceFs.start(root, meta)
            stops.insert(0, fs.stop)
            w, r = fs.mount("writer"), fs.mount("reader")
            (w.path / "kvtier").mkdir()
            sharedfs, sharedfs_read = w.path / "kvtier", r.path / "kvtier"
            log(f"[stores] JuiceFS volume mounted twice: {w.path}, {r.path}")
        if not valkey:
            from kvtier.services.valkey_server import ValkeyServer

            srv = ValkeyServer.start(root, maxmemory="4gb", policy="allkeys-lru", name="data-valkey")
            stops.insert(0, srv.stop)
            valkey = srv.url
            log(f"[stores] Valkey server on {srv.host}:{srv.port}")
        base = {"kind": "sharedfs", "janitor": False}
        yield [SharedTarget("sharedfs", {**base, "path": str(sharedfs)},
                            {**base, "path": str(sharedfs_read or sharedfs)}),
               SharedTarget("valkey", {"kind": "valkey", "url": valkey}, {"kind": "valkey", "url": valkey})]
    finally:
        for stop in stops:
            try:
                stop()
            except Exception as e:           # one service failing to stop must not keep the others up
                log(f"[stores] stopping a service: {type(e).__name__}: {e}")
        if stops and not _mounted_under(root):
            shutil.rmtree(root, ignore_errors=True)


def _mounted_under(root: Path) -> bool:
    try:
        with open("/proc/self/mounts") as fh:
            return any(line.split()[1].startswith(str(root)) for line in fh)
    except OSError:
        return True
