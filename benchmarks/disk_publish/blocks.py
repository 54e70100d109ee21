"""What the disk-publish scripts share: O_DIRECT chunk files of one size written block by block (64
MiB of files per block), the variants interleaved in an order that rotates with the block and the
round, each block timed until written back; then GB/s per variant and the per-block ratio against a
base variant."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kvtier.bench.store_bench_files import random_buffer, remove_settled
from kvtier.chunk import file_size
from kvtier.tiers.diskio import ALIGN
from kvtier.tiers.disklayout import NamespaceDir

def files_per_block(chunk: int) -> int:
    """Chunk files of ``chunk`` payload bytes in one 64 MiB block (at least one)."""
    return max(1, (64 << 20) // chunk)


#: writes one block: (layout, file names, source buffer, file bytes, variant) -> seconds, written back
WriteBlock = Callable[[NamespaceDir, list[str], memoryview, int, str], float]


def time_blocks(root: Path, chunk: int, blocks: int, variants: Sequence[str],
                make_layout: Callable[[Path, str], NamespaceDir], write_block: WriteBlock,
                rounds: int = 2) -> dict[str, list[float]]:
    """Seconds per block of each variant, ``rounds`` x ``blocks`` blocks; every variant writes into
    its own fresh layout under ``root`` each round (removed after it)."""
    fbytes = file_size(chunk)
    src = random_buffer(-(-fbytes // ALIGN) * ALIGN, 3)
    per = files_per_block(chunk)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        lays = {v: make_layout(root / f"{v}-{r}", v) for v in variants}
        os.sync()
        for b in range(blocks):
            names = [os.urandom(32).hex() for _ in range(per)]
            k = (b + r) % len(variants)
            for v in [*variants[k:], *variants[:k]]:
                times[v].append(write_block(lays[v], names, src, fbytes, v))
        for v in variants:
            remove_settled(root / f"{v}-{r}")
    print(f"{rounds} rounds x {blocks} blocks of {per} chunk files of {chunk / 2**20:.2f} MiB payload")
    return times


def timed(write_files: Callable[[], None]) -> float:
    """Seconds of ``write_files`` and the write-back after it."""
    t = time.perf_counter()
    write_files()
    os.sync()
    return time.perf_counter() - t


def print_figures(times: dict[str, list[float]], chunk: int, base: str) -> None:
    """GB/s of each variant and its per-block ratio against ``base`` (above 1: faster)."""
    n = len(next(iter(times.values())))
    per = files_per_block(chunk)
    for v, ts in times.items():
        print(f"{v:16s} {n * per * chunk / 1e9 / sum(ts):.3f} GB/s")
    b = np.array(times[base])
    for v in times:
        if v != base:
            ratio = b / np.array(times[v])
            print(f"{v} / {base}, per block: median {np.median(ratio):.3f}, mean {ratio.mean():.3f}")


def arguments(usage: str, default_blocks: int) -> tuple[Path, int, int]:
    """DIR [CHUNK_MIB] [BLOCKS] from the command line (exits with ``usage`` without DIR)."""
    if len(sys.argv) < 2:
        sys.exit(usage)
    return (Path(sys.argv[1]), int(float(sys.argv[2] if len(sys.argv) > 2 else 5.62) * 2**20),
            int(sys.argv[3]) if len(sys.argv) > 3 else default_blocks)
