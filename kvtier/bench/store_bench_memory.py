"""The memory pass of ``kvtier bench store``: ``MemoryTier`` put / ``get_into`` against a plain
memcpy of the same bytes, the two passes back to back in every round."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvtier.bench.store_bench_files import aligned_buffer, bench_namespace, random_buffer
from kvtier.bench.store_bench_rounds import GB, TOKENS, latency_ms, order, ratio_stats, spread
from kvtier.chunk import ChunkMeta
from kvtier.keys import chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.memory import MemoryTier


def bench_memory(chunk: int, n: int, repeat: int, passes: int) -> dict:
    """memcpy vs MemoryTier, ``repeat`` rounds of (baseline, tier) passes back to back."""
    src = random_buffer(chunk, 0)
    out = aligned_buffer(chunk)
    slab = aligned_buffer(chunk * n)
    for i in range(n):          # real data in the slab: the get baseline must not read the zero page
        slab[i * chunk:(i + 1) * chunk] = src
    tier = MemoryTier.open(n * ((chunk + 4095) // 4096 * 4096), prefault=True, telemetry=Telemetry())
    keys = chunk_keys(bench_namespace(chunk), np.arange(n * TOKENS))
    metas = [ChunkMeta(k, None, TOKENS, (chunk,), "uint8", chunk) for k in keys]
    t0 = time.perf_counter()
    for m in metas:        # first fill: allocates (and with prefault populates) the slab once
        assert tier.put(m, src)
    first_fill = n * chunk / (time.perf_counter() - t0) / GB
    vol = passes * n * chunk

    def memcpy_put(latency_ms: list) -> float:
        t0 = time.perf_counter()
        for _ in range(passes):
            for i in range(n):
                slab[i * chunk:(i + 1) * chunk] = src
        return vol / (time.perf_counter() - t0) / GB

    def memcpy_get(latency_ms: list) -> float:
        t0 = time.perf_counter()
        for _ in range(passes):
            for i in range(n):
                out[:chunk] = slab[i * chunk:(i + 1) * chunk]
        return vol / (time.perf_counter() - t0) / GB

    def tier_put(lat: list) -> float:
        ts = []
        for _ in range(passes):
            for k in keys:
                tier.delete(k)
            for m in metas:
                t = time.perf_counter()
                assert tier.put(m, src)
                ts.append(time.perf_counter() - t)
        lat += ts
        return vol / sum(ts) / GB

    def tier_get(lat: list) -> float:
        ts = []
        for _ in range(passes):
            for k in keys:
                t = time.perf_counter()
                assert tier.get_into(k, out) is not None
                ts.append(time.perf_counter() - t)
        lat += ts
        return vol / sum(ts) / GB

    fig: dict[str, list[float]] = {"memcpy": [], "memcpy_put": [], "get": [], "put": []}
    lats: dict[str, list[float]] = {"get": [], "put": []}
    fns: dict[str, Callable[[list], float]] = {"memcpy": memcpy_get, "get": tier_get,
                                                "memcpy_put": memcpy_put, "put": tier_put}
    for r in range(repeat):
        for base, mine in (("memcpy", "get"), ("memcpy_put", "put")):
            for name in order(r, base, mine):
                fig[name].append(fns[name](lats.get(name, [])))
    tier.close()
    slab.release()
    res = {"memcpy_gbps": spread(fig["memcpy"])["median"], "memcpy_put_gbps": spread(fig["memcpy_put"])["median"],
           "get_gbps": spread(fig["get"])["median"], "put_gbps": spread(fig["put"])["median"],
           "get_vs_memcpy": ratio_stats(fig["get"], fig["memcpy"]),
           "put_vs_memcpy": ratio_stats(fig["put"], fig["memcpy_put"]),
           "spread": {f"{k}_gbps": spread(v) for k, v in fig.items()},
           "first_fill_gbps": round(first_fill, 3), "get": latency_ms(lats["get"]), "put": latency_ms(lats["put"]),
           "chunks": n, "passes_per_round": passes, "rounds": repeat}
    return res
