"""Buffers, files and the machine of ``kvtier bench store``: page-aligned pre-faulted buffers,
random payloads, page-cache drops, removals that wait for the filesystem to settle, the
benchmark's namespace, and what the machine and its disk are."""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np

from kvtier.bench.store_bench_rounds import TOKENS
from kvtier.keys import Namespace
from kvtier.tiers.diskio import ALIGN


def aligned_buffer(n: int) -> memoryview:
    m = mmap.mmap(-1, (n + ALIGN - 1) // ALIGN * ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return memoryview(m)


def random_buffer(n: int, seed: int) -> memoryview:
    buf = aligned_buffer(n)
    buf[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return buf[:n]


def drop_page_cache(paths: list[str]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove_settled(p: Path) -> None:
    """Delete a file or tree and wait until the filesystem settled: with online discard (this
    VM mounts ext4 with ``discard``) freeing 1 GiB issues discards at the next journal commit,
    which would otherwise slow whichever timed pass comes next."""
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()
    os.sync()


def bench_namespace(chunk_bytes: int) -> Namespace:
    return Namespace("bench", f"chunk{chunk_bytes}", "bfloat16", "bench", 16, TOKENS)


def virtual_disk_note(path: Path) -> str | None:
    """A warning when ``path`` lives on a virtual block device (its host may cache it)."""
    try:
        dev = os.stat(path).st_dev
        sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        disk = sysdev.parent if (sysdev / "partition").exists() else sysdev
        driver = (disk / "device" / "driver").resolve().name if (disk / "device" / "driver").exists() else ""
        name = disk.name
    except OSError:
        return None
    if driver.startswith("virtio") or name.startswith(("vd", "xvd")):
        return (f"{name} is a virtual disk ({driver or 'virtual'}): O_DIRECT bypasses this guest's page cache, "
                "but the host may serve reads from its own cache, so disk figures can exceed the device")
    return None


def machine(path: Path) -> dict:
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "?")
    df = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "mem_total_kib": int(mem), "kernel": platform.release(),
            "virtual_disk_note": virtual_disk_note(path),
            "python": platform.python_version(), "df": df, "fs_type": df.splitlines()[-1].split()[1] if df else "?",
            "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")}
