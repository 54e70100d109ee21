"""``kvtier calibrate``: measure a running OpenAI-compatible vLLM server and the local tiers,
and build the simulator profile from it.

Server measurements (completions API with token-id prompts, streamed, one at a time unless
stated; random ids from a seeded generator so no two probes share a prefix by accident):

1. cold prefill: TTFT of fresh prompts of each length in ``lengths`` (prefill vs length);
2. cached prefix: a prompt of length L, then the same prompt plus ``suffix`` new tokens
   (prefill vs cached-prefix length; the server's reported ``cached_tokens`` is used when it
   reports them, else L rounded down to whole blocks);
3. decode: the mean inter-token gap of one request, and of ``batch`` concurrent requests
   (decode step vs batch size: the batching effect).

Local tiers: RAM read bandwidth (numpy copy of ``probe_bytes``), and, with ``disk_path``,
SSD write and read bandwidth of a ``probe_bytes`` file (fsynced, then dropped from the page
cache with ``posix_fadvise(DONTNEED)`` before the read; removed afterwards).
Every request has a deadline (``timeout_s``); a failed probe is a one-line CalibrateError.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvtier.client.stream import ClientOptions, RequestRecord, discover_model, make_http_client, send_turn
from kvtier.sim.fit import DecodeSample, Fit, PrefillSample, fit_engine
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile
from kvtier.workload.format import Conversation, Turn


class CalibrateError(RuntimeError):
    """A probe failed (unreachable server, HTTP error, timeout); one line."""


@dataclass(frozen=True)
class CalibrateOptions:
    url: str
    model: str | None = None
    lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    suffix: int = 64
    repeats: int = 2
    batch: int = 4
    decode_tokens: int = 16
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int = 100_000
    kv_bytes_per_token: int = 131072
    vocab: tuple[int, int] = (1000, 30000)
    timeout_s: float = 300.0
    seed: int = 0
    disk_path: Path | None = None
    probe_bytes: int = 256 * 2**20

    def validate(self) -> None:
        if not self.lengths or min(self.lengths) < 2:
            raise CalibrateError("--lengths must be token counts >= 2")
        if self.repeats < 1 or self.batch < 2 or self.decode_tokens < 3 or self.suffix < 1:
            raise CalibrateError("need repeats >= 1, batch >= 2, decode-tokens >= 3, suffix >= 1")
        if self.timeout_s <= 0:
            raise CalibrateError("--request-timeout must be > 0")


@dataclass
class Measurements:
    model: str
    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)
    ram_read_bw: float | None = None
    ssd_read_bw: float | None = None
    ssd_write_bw: float | None = None


def _conv(ids: list[int], max_tokens: int, name: str) -> Conversation:
    return Conversation(id=name, turns=[Turn(prompt_token_ids=ids, max_tokens=max_tokens)])


async def _send(client: httpx.AsyncClient, model: str, conv: Conversation, opts: ClientOptions) -> RequestRecord:
    rec = await send_turn(client, model, conv, 0, opts, time.perf_counter())
    if not rec.ok:
        raise CalibrateError(f"probe {conv.id} failed: {rec.error_kind}: {rec.error}")
    return rec


async def measure_server(o: CalibrateOptions) -> Measurements:
    rng = random.Random(o.seed)
    copts = ClientOptions(request_timeout_s=o.timeout_s, ignore_eos=True)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*o.vocab) for _ in range(n)]
    async with make_http_client(o.url, copts) as client:
        try:
            model = o.model or await discover_model(client)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise CalibrateError(f"cannot reach the server at {o.url}: {e}") from None
        m = Measurements(model)
        await _send(client, model, _conv(ids(16), 1, "warmup"), copts)
        for rep in range(o.repeats):
            for n in o.lengths:
                r = await _send(client, model, _conv(ids(n), 1, f"cold-{n}-{rep}"), copts)
                m.prefill.append(PrefillSample(n, 0, float(r.ttft_s)))
                base = ids(n)
                await _send(client, model, _conv(base, 1, f"prefix-{n}-{rep}"), copts)
                r = await _send(client, model, _conv(base + ids(o.suffix), 1, f"cached-{n}-{rep}"), copts)
                cached = r.cached_tokens if r.cached_tokens is not None else n // o.block_size * o.block_size
                total = r.prompt_tokens or n + o.suffix
                m.prefill.append(PrefillSample(total - cached, cached, float(r.ttft_s)))
        for d in (1, o.batch):
            recs = await asyncio.gather(*(_send(client, model, _conv(ids(32), o.decode_tokens, f"dec-{d}-{i}"), copts)
                                          for i in range(d)))
            gaps = [g for r in recs for g in r.itl_s[1:]]       # the first gap may include others' prefills
            if not gaps:
                raise CalibrateError("the server streamed no inter-token gaps (decode step not measurable)")
            m.decode.append(DecodeSample(d, float(np.median(gaps))))
    return m


def measure_ram(nbytes: int) -> float:
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_disk(path: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of one file under ``path`` (removed afterwards)."""
    path.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(1 << 20) * (nbytes >> 20)
    fd, name = tempfile.mkstemp(prefix=".kvtier-calib-", dir=path)
    try:
        t = time.perf_counter()
        os.write(fd, buf)
        os.fsync(fd)
        w = time.perf_counter() - t
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t = time.perf_counter()
        got = 0
        while got < len(buf):
            chunk = os.read(fd, 8 << 20)
            if not chunk:
                break
            got += len(chunk)
        r = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(name)
    return len(buf) / w, got / r


def build_profile(m: Measurements, o: CalibrateOptions, fit: Fit) -> SimProfile:
    eng = EngineProfile(block_size=o.block_size, max_num_batched_tokens=o.max_num_batched_tokens,
                        kv_cache_tokens=o.kv_cache_tokens, step_overhead_s=fit.step_overhead_s,
                        prefill_token_s=fit.prefill_token_s, prefill_attn_s=fit.prefill_attn_s,
                        decode_seq_s=fit.decode_seq_s, request_overhead_s=fit.request_overhead_s)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    prof = SimProfile(
        description=f"{m.model} at {o.url}, calibrated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        source=f"kvtier calibrate: {len(m.prefill)} prefill probes (mean fit error {fit.prefill_rel_error:.1%}), "
               f"decode at 1 and {o.batch} sequences; CPU {cpu}, {os.cpu_count()} CPUs",
        kv_bytes_per_token=o.kv_bytes_per_token, engine=eng)
    if m.ram_read_bw:
        prof.ram = TierProfile(capacity=0, read_bw=m.ram_read_bw, write_bw=m.ram_read_bw)
    if m.ssd_read_bw and m.ssd_write_bw:
        prof.ssd = TierProfile(capacity=0, read_bw=m.ssd_read_bw, write_bw=m.ssd_write_bw,
                               op_latency_s=prof.ssd.op_latency_s)
    return prof


def calibrate(o: CalibrateOptions) -> tuple[SimProfile, Measurements, Fit]:
    o.validate()
    m = asyncio.run(measure_server(o))
    m.ram_read_bw = measure_ram(o.probe_bytes)
    if o.disk_path is not None:
        m.ssd_write_bw, m.ssd_read_bw = measure_disk(o.disk_path, o.probe_bytes)
    fit = fit_engine(m.prefill, m.decode, o.max_num_batched_tokens)
    return build_profile(m, o, fit), m, fit
