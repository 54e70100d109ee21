"""What publishing costs a disk-tier put: O_DIRECT chunk files written block by block (64 MiB), three
ways interleaved in rotating order within each block: never renamed (``create``), renamed into a
fan-out directory made on first use (``publish_fresh``), renamed into directories made beforehand
(``publish_premade``, what the tier does since it makes them at open). Same bytes, same files, each
block timed until written back. Prints GB/s and the per-block ratio against ``create``.

    python benchmarks/disk_publish/publish_cost.py DIR [CHUNK_MIB] [BLOCKS]
"""

from __future__ import annotations

from pathlib import Path

from blocks import arguments, print_figures, time_blocks

from kvtier.bench.store_bench_files import remove_settled
from kvtier.bench.store_bench_raw import prepare_layout, write_files
from kvtier.tiers.disklayout import NamespaceDir

VARIANTS = ("create", "publish_fresh", "publish_premade")


def _layout(d: Path, variant: str) -> NamespaceDir:
    remove_settled(d)
    lay = NamespaceDir(d)
    prepare_layout(lay, fanout=variant == "publish_premade")
    return lay


def _write(lay: NamespaceDir, names: list[str], src: memoryview, fbytes: int, variant: str) -> float:
    return write_files(lay, names, src, fbytes, o_direct=True, shape="create" if variant == "create" else "publish")


def main(root: Path, chunk: int, blocks: int) -> None:
    print_figures(time_blocks(root, chunk, blocks, VARIANTS, _layout, _write), chunk, base="create")


if __name__ == "__main__":
    main(*arguments("usage: publish_cost.py DIR [CHUNK_MIB] [BLOCKS]", 12))
