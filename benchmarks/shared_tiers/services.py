"""The shared backends of the benchmarks, started from tests/services on 127.0.0.1 (and stopped):
a JuiceFS volume mounted twice (metadata in Valkey, data in a local directory; "machine A"
writes through mount a, "machine B" reads through mount b with its own cache dir, and by default
no block cache: ``READER_MOUNT_OPTIONS``), a Valkey
server (maxmemory 4gb, allkeys-lru) and a Mooncake master + standalone pool owner (TCP).

``services(tmp, pool_bytes, {"sharedfs", "valkey", "mooncake"})`` yields ``Endpoints``: the
command-line options of `kvtier bench ttft` / `kvtier demo longdoc` naming them, and the service
objects themselves (to pause them).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "sharedfs"))


@dataclass
class Endpoints:
    write_dir: Path | None = None       # sharedfs: the directory through mount a ("machine A")
    read_dir: Path | None = None        # the same directory through mount b ("machine B")
    data_dir: Path | None = None        # JuiceFS's data directory (evicted from the page cache before hits)
    valkey: str = ""
    mooncake: str = ""
    handles: dict[str, Any] = field(default_factory=dict)   # juicefs, mount_a, mount_b, valkey, mooncake

    def ttft_options(self) -> list[str]:
        o = []
        if self.write_dir:
            o += ["--sharedfs", str(self.write_dir), "--sharedfs-read", str(self.read_dir),
                  "--sharedfs-evict", str(self.data_dir)]
        o += ["--valkey", self.valkey] if self.valkey else []
        return o + (["--mooncake", self.mooncake] if self.mooncake else [])

    def longdoc_options(self, kinds: list[str]) -> list[str]:
        o = ["--shared", ",".join(kinds)]
        if self.write_dir and "sharedfs" in kinds:
            o += ["--sharedfs", str(self.write_dir), "--sharedfs-read", str(self.read_dir),
                  "--sharedfs-evict", str(self.data_dir)]
        o += ["--valkey", self.valkey] if self.valkey and "valkey" in kinds else []
        return o + (["--mooncake", self.mooncake] if self.mooncake and "mooncake" in kinds else [])


#: `juicefs mount` options of "machine B" (the reader): no JuiceFS block cache. kvtier is the cache:
#: a shared-tier hit is promoted into the reading engine's own RAM (and SSD) tier, so that machine
#: reads each chunk from the shared filesystem once and JuiceFS's local copy of every block read
#: (written, checksummed, as dirty page cache on a 2-core VM) is pure overhead — JuiceFS's docs advise
#: turning the cache off for read-once data. Why: docs/store-design.md, "The client's own block cache".
READER_MOUNT_OPTIONS: tuple[str, ...] = ("--cache-size", "0")


@contextlib.contextmanager
def services(tmp: Path, pool_bytes: int, which: set[str],
             reader_mount_options: tuple[str, ...] = READER_MOUNT_OPTIONS):
    """Start the backends named in ``which``; yield their ``Endpoints``; stop them on exit.
    ``reader_mount_options``: extra `juicefs mount` options of mount b (``()``: JuiceFS's defaults)."""
    from common import juicefs_volume
    from tests.services.mooncake import MooncakeCluster
    from kvtier.services.valkey_server import ValkeyServer

    with contextlib.ExitStack() as stack:
        ep = Endpoints()
        if "sharedfs" in which:
            fs, _meta = stack.enter_context(juicefs_volume(tmp / "jfs"))
            a, b = fs.mount("a"), fs.mount("b", extra=list(reader_mount_options))
            (a.path / "kv").mkdir()
            end = time.time() + 30
            while not (b.path / "kv").is_dir() and time.time() < end:
                time.sleep(0.05)
            ep.write_dir, ep.read_dir, ep.data_dir = a.path / "kv", b.path / "kv", fs.root / "bucket"
            ep.handles.update(juicefs=fs, mount_a=a, mount_b=b)
        if "valkey" in which:
            v = ValkeyServer.start(tmp, maxmemory="4gb", policy="allkeys-lru", name="valkey-data")
            stack.callback(v.stop)
            ep.valkey, ep.handles["valkey"] = v.url, v
        if "mooncake" in which:
            mc = MooncakeCluster.start(tmp / "mc", segment_bytes=pool_bytes)
            stack.callback(mc.stop)
            ep.mooncake, ep.handles["mooncake"] = f"{mc.master_addr},{mc.metadata_url}", mc
        yield ep
