"""What publishing costs a disk-tier put: O_DIRECT chunk files written block by block (64 MiB), three
ways interleaved in rotating order within each block: never renamed (``create``), renamed into a
fan-out directory made on first use (``publish_fresh``), renamed into directories made beforehand
(``publish_premade``, what the tier does since it makes them at open). Same bytes, same files, each
block timed until written back. Prints GB/s and the per-block ratio against ``create``.

    python benchmarks/disk_publish/publish_cost.py DIR [CHUNK_MIB] [BLOCKS]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from kvtier.bench.store_bench_files import random_buffer, remove_settled
from kvtier.bench.store_bench_raw import prepare_layout, write_files
from kvtier.chunk import file_size
from kvtier.tiers.diskio import ALIGN
from kvtier.tiers.disklayout import NamespaceDir

VARIANTS = ("create", "publish_fresh", "publish_premade")


def _layout(d: Path, premade: bool) -> NamespaceDir:
    remove_settled(d)
    lay = NamespaceDir(d)
    prepare_layout(lay, fanout=premade)
    return lay


def main(root: Path, chunk: int, blocks: int, rounds: int = 2) -> None:
    fbytes = file_size(chunk)
    src = random_buffer(-(-fbytes // ALIGN) * ALIGN, 3)
    per = max(1, (64 << 20) // chunk)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        lays = {v: _layout(root / f"{v}-{r}", v == "publish_premade") for v in VARIANTS}
        os.sync()
        for b in range(blocks):
            names = [os.urandom(32).hex() for _ in range(per)]
            k = (b + r) % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                shape = "create" if v == "create" else "publish"
                times[v].append(write_files(lays[v], names, src, fbytes, o_direct=True, shape=shape))
        for v in VARIANTS:
            remove_settled(root / f"{v}-{r}")
    vol = rounds * blocks * per * chunk / 1e9
    for v, ts in times.items():
        print(f"{v:16s} {vol / sum(ts):.3f} GB/s")
    base = np.array(times["create"])
    for v in VARIANTS[1:]:
        ratio = base / np.array(times[v])
        print(f"{v} / create, per block: median {np.median(ratio):.3f}, mean {ratio.mean():.3f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: publish_cost.py DIR [CHUNK_MIB] [BLOCKS]")
    main(Path(sys.argv[1]), int(float(sys.argv[2] if len(sys.argv) > 2 else 5.62) * 2**20),
         int(sys.argv[3]) if len(sys.argv) > 3 else 12)
