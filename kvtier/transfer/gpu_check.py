"""``kvtier doctor --gpu``: kvtier's block copies on one GPU, against KV views shaped as vLLM shapes them.

Torch and ``kvtier.transfer`` only (no vLLM). The views are built as vLLM 0.32's ``create_kv_cache_views``
builds them: one flat int8 allocation, per-layer ``[num_blocks, H, N, C]`` byte views in the LBHNC layout
the connector asks for, then viewed as the cache dtype; by default a Llama-3-8B cache (32 layers, 8 KV
heads, head size 128, block 16, 1024 blocks), chunks of 256 tokens, loads and saves of 8K tokens. Checks:
1. the views are what ``derive_views`` serves (``lbhnc``, every layer in one ``[L, B, page]`` view);
2. random blocks round-trip device -> host chunks -> other device blocks bit-exactly (bf16 and fp8);
3. a load is ordered after the compute stream: blocks zeroed on a busy compute stream, loaded with
   ``follow_compute`` / ``scatter`` / ``fence``, read back there as stored (the same load without
   ``follow_compute`` shows whether the race is observable: information only);
4. host synchronisations of a load and of a save (torch's sync debug mode; the save's claims that waited);
5. load and save rates against torch's own pinned ``copy_`` of as many bytes (target: 0.8 of it).
It cannot prove that vLLM works with kvtier on this GPU: no vLLM engine runs, the views are a replica
(the unit tests compare their strides with vLLM's own), the compute stream's work is a stand-in (a sleep
kernel and the zeroing of new blocks) and no attention kernel reads the loaded blocks.
Exit code: 0 when checks 1-3 pass, 1 on a bit mismatch or an exception, 2 without a CUDA device
(``--device cpu`` runs the same checks on the CPU, ``--small`` with a small cache).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, TypeVar

import torch

from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.host_buffers import HostBuffer
from kvtier.transfer.page_layout import LBHNC
from kvtier.transfer.streams import Streams, streams_for
from kvtier.transfer.views import KVViews, derive_views

GIB = 2**30
STALL_CYCLES = 600_000_000    # ~0.3 s of GPU clock on the compute stream; an 8K-token load takes ~50 ms
RATE_TARGET = 0.8             # kvtier's rate / torch's pinned copy rate
#: the fp8 cache dtypes: uint8 (how vLLM allocates --kv-cache-dtype fp8) and torch's float8 (fp8_inc)
FP8_DTYPES = {"uint8": torch.uint8}
if hasattr(torch, "float8_e4m3fn"):
    FP8_DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn
DEFAULT_FP8 = "float8_e4m3fn" if "float8_e4m3fn" in FP8_DTYPES else "uint8"
Row = tuple[str, str, str]    # (check, status, detail)
Chunks = list[list[int]]      # block ids, chunk by chunk
T = TypeVar("T")


@dataclass(frozen=True)
class Shape:
    """The cache and the transfer sizes (defaults: Llama-3-8B, chunks of 256 tokens, an 8K-token load)."""

    layers: int = 32
    heads: int = 8
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 1024
    chunk_tokens: int = 256
    load_tokens: int = 8192

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def chunks(self) -> int:
        return self.load_tokens // self.chunk_tokens

    def validate(self) -> None:
        """ValueError (one line) when the sizes do not fit together."""
        if self.load_tokens <= 0 or self.chunk_tokens % self.block_size or self.load_tokens % self.chunk_tokens:
            raise ValueError(f"a load of {self.load_tokens} tokens must be whole chunks of {self.chunk_tokens} "
                             f"tokens, of whole blocks of {self.block_size}")
        if 2 * self.chunks * self.chunk_blocks > self.num_blocks:
            raise ValueError(f"{self.num_blocks} blocks cannot hold the {self.load_tokens}-token load and its "
                             f"source apart ({2 * self.chunks * self.chunk_blocks} blocks)")


SMALL = Shape(layers=4, heads=2, head_size=16, num_blocks=64, chunk_tokens=64, load_tokens=256)


@dataclass(frozen=True)
class RoundTrip:
    dtype: str
    layout: str         # what derive_views made of the views
    stacked: bool       # one [L, B, page] view covers every layer
    pages: int          # (layer, block) pages compared
    mismatched: int

    @property
    def ok(self) -> bool:
        return self.mismatched == 0 and self.layout == LBHNC.name and self.stacked


@dataclass(frozen=True)
class Race:
    followed: bool      # the load called follow_compute
    pages: int
    mismatched: int     # pages read back on the compute stream unlike what was stored

    @property
    def ok(self) -> bool:
        return self.mismatched == 0


@dataclass(frozen=True)
class Syncs:
    chunks: int
    load: int | None    # sync debug warnings; None where torch has no sync debug mode (a CPU)
    save: int | None
    save_waits: int     # the save's claims whose copy was still in flight


@dataclass(frozen=True)
class Timing:
    direction: str      # "load" (host -> device) or "save"
    tokens: int
    nbytes: int
    kvtier_s: float     # medians
    torch_s: float

    @property
    def ratio(self) -> float:
        """kvtier's rate over torch's."""
        return self.torch_s / self.kvtier_s


@dataclass
class Report:
    env: list[tuple[str, str]]
    round_trips: list[RoundTrip] = field(default_factory=list)
    races: list[Race] = field(default_factory=list)
    syncs: Syncs | None = None
    timings: list[Timing] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)     # (check, exception)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def build_views(num_layers: int, heads: int, head_size: int, block_size: int, num_blocks: int,
                dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Per-layer ``[num_blocks, heads, block_size, 2 * head_size]`` views of one flat int8 allocation of
    random bytes, laid out LBHNC as vLLM's ``create_kv_cache_views`` lays them out: a byte view
    ``[L, B, H, N, C bytes]`` (layer stride ``num_blocks * page``, block stride ``page``), each layer's
    content axis then viewed as ``dtype``."""
    content = 2 * head_size * dtype.itemsize                  # K and V side by side, in bytes
    page = heads * block_size * content
    raw = torch.empty(num_layers * num_blocks * page, dtype=torch.int8, device=device)
    raw.random_(-128, 128, generator=torch.Generator(device=raw.device).manual_seed(seed))
    cache = torch.as_strided(raw, (num_layers, num_blocks, heads, block_size, content),
                             (num_blocks * page, page, block_size * content, content, 1), raw.storage_offset())
    return [cache[i].view(dtype) for i in range(num_layers)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _index(kv: KVViews, chunks: Chunks) -> torch.Tensor:
    return torch.tensor([b for ids in chunks for b in ids], dtype=torch.long, device=kv.device)


def _read(kv: KVViews, idx: torch.Tensor) -> list[torch.Tensor]:
    """The bytes of blocks ``idx``, per layer ``[n, page bytes]`` (on the current stream)."""
    return [p.view(torch.uint8).index_select(0, idx) for p in kv.pages]


def _mismatched(got: list[torch.Tensor], want: list[torch.Tensor]) -> int:
    """Pages (rows) of ``got`` unlike those of ``want``."""
    return int(sum((g != w).any(-1).sum() for g, w in zip(got, want)))


def save(copier: BlockCopier, chunks: Chunks, bufs: list[HostBuffer]) -> int:
    """Gather ``chunks`` into ``bufs`` and claim each for the host; returns the claims that had to wait."""
    copier.follow_compute()
    for ids, buf in zip(chunks, bufs):
        copier.gather(ids, buf)
    waits = 0
    for buf in bufs:
        waits += buf.busy()
        buf.claim().bytes()
    return waits


def load(copier: BlockCopier, chunks: Chunks, bufs: list[HostBuffer], follow: bool = True) -> None:
    """The connector's load on the caller's (compute) stream: follow it, scatter, fence it."""
    if follow:
        copier.follow_compute()
    event = None
    for ids, buf in zip(chunks, bufs):
        event = copier.scatter(ids, 0, buf)
    copier.fence(event)


def _saved(copier: BlockCopier, shape: Shape, seed: int) -> tuple[Chunks, Chunks, list[HostBuffer]]:
    """Random source chunks saved into host buffers, and as many random destination chunks apart."""
    n, per = shape.chunks, shape.chunk_blocks
    ids = torch.randperm(copier.views.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks = [ids[i:i + per] for i in range(0, 2 * n * per, per)]
    bufs = [copier.new_buffer() for _ in range(n)]
    save(copier, chunks[:n], bufs)
    return chunks[:n], chunks[n:], bufs


def round_trip(copier: BlockCopier, shape: Shape, seed: int = 1) -> RoundTrip:
    """Save random blocks into host chunks, load them into other random blocks, compare their bytes."""
    kv = copier.views
    src, dst, bufs = _saved(copier, shape, seed)
    load(copier, dst, bufs)
    _sync(kv.device)
    got = _read(kv, _index(kv, dst))
    return RoundTrip(_name(kv.dtype), kv.layout.name, kv.stacked is not None, kv.num_layers * len(got[0]),
                     _mismatched(got, _read(kv, _index(kv, src))))


def race(copier: BlockCopier, shape: Shape, follow: bool = True, seed: int = 2) -> Race:
    """On a new compute stream: a long kernel, the zeroing of the destination blocks, the load (its
    transfer stream following the compute stream when ``follow``), then the blocks read back."""
    kv, streams = copier.views, copier.streams
    src, dst, bufs = _saved(copier, shape, seed)
    dst_idx = _index(kv, dst)                 # on the device before the compute stream is busy
    with streams.on(streams.new_stream()):
        if kv.device.type == "cuda":
            torch.cuda._sleep(STALL_CYCLES)
        for page in kv.pages:
            page.view(torch.uint8).index_fill_(0, dst_idx, 0)       # vLLM zeroes newly allocated blocks
        load(copier, dst, bufs, follow=follow)
        got = _read(kv, dst_idx)
    _sync(kv.device)
    return Race(follow, kv.num_layers * len(dst_idx), _mismatched(got, _read(kv, _index(kv, src))))


def count_syncs(copier: BlockCopier, shape: Shape, seed: int = 3) -> Syncs:
    """The host synchronisations torch's sync debug mode reports during a load and during a save of
    ``shape.chunks`` chunks (each after a warm-up; None on a CPU), and the save's claims that waited."""
    device = copier.views.device
    src, dst, bufs = _saved(copier, shape, seed)
    load(copier, dst, bufs)
    _sync(device)

    def counted(work: Callable[[], T]) -> tuple[int | None, T]:
        if device.type != "cuda":
            return None, work()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = work()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        _sync(device)
        return sum("synchroniz" in str(w.message) for w in caught), result

    on_load, _ = counted(lambda: load(copier, dst, bufs))
    on_save, waits = counted(lambda: save(copier, src, bufs))
    return Syncs(shape.chunks, on_load, on_save, waits)


def time_transfers(copier: BlockCopier, shape: Shape, repeats: int, seed: int = 4) -> list[Timing]:
    """Median wall times of a load and a save through ``copier``, and of torch's copies of as many bytes
    between one pinned host tensor and one device tensor."""
    device = copier.views.device
    src, dst, bufs = _saved(copier, shape, seed)
    nbytes = sum(b.nbytes for b in bufs)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(work: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats + 1):                # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            work()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    return [Timing("load", shape.load_tokens, nbytes, timed(lambda: load(copier, dst, bufs)),
                   timed(lambda: dev.copy_(host, non_blocking=True))),
            Timing("save", shape.load_tokens, nbytes, timed(lambda: save(copier, src, bufs)),
                   timed(lambda: host.copy_(dev, non_blocking=True)))]


def _attempt(report: Report, check: str, work: Callable[[], T]) -> T | None:
    try:
        return work()
    except Exception as e:      # a check that raises is a failed row of the report
        report.errors.append((check, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        return None


def _copier(shape: Shape, dtype: torch.dtype, device: torch.device, streams: Streams) -> BlockCopier:
    layers = build_views(shape.layers, shape.heads, shape.head_size, shape.block_size, shape.num_blocks,
                         dtype, device)
    return BlockCopier(derive_views(layers, shape.block_size, expected=LBHNC), shape.chunk_blocks, streams)


def environment(device: torch.device, shape: Shape) -> list[tuple[str, str]]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
    s = shape
    cache = s.layers * s.num_blocks * s.heads * s.block_size * 2 * s.head_size * 2
    return [("device", name), ("torch", torch.__version__), ("CUDA", torch.version.cuda or "none"),
            ("shape", f"{s.layers} layers x {s.heads} KV heads x head {s.head_size}, block {s.block_size}, "
                      f"{s.num_blocks} blocks (bf16 cache {_size(cache)}); chunk {s.chunk_tokens} tokens; "
                      f"load {s.load_tokens} tokens ({s.chunks} chunks)")]


def run_checks(shape: Shape, device: str | torch.device, fp8: torch.dtype, repeats: int = 5) -> Report:
    """Every check on ``device``: views and round trip in bf16 and ``fp8``; race, syncs and rates in bf16."""
    device = torch.device(device)
    report = Report(environment(device, shape))
    streams = streams_for(device)
    for dtype in (torch.bfloat16, fp8):
        name = _name(dtype)
        copier = _attempt(report, f"views {name}", lambda: _copier(shape, dtype, device, streams))
        if copier is None:
            continue
        report.round_trips += filter(None, [_attempt(report, f"round trip {name}", lambda: round_trip(copier, shape))])
        if dtype == torch.bfloat16:
            report.races += filter(None, [_attempt(report, "race", lambda: race(copier, shape)),
                                          _attempt(report, "race control", lambda: race(copier, shape, False))])
            report.syncs = _attempt(report, "host syncs", lambda: count_syncs(copier, shape))
            report.timings = _attempt(report, "rates", lambda: time_transfers(copier, shape, repeats)) or []
    return report


def rows(report: Report) -> list[Row]:
    """The table's rows: the environment, one row per check and figure, then the exceptions."""
    out: list[Row] = [(label, "", value) for label, value in report.env]
    out += [(f"round trip {r.dtype}", "ok" if r.ok else "FAIL",
             f"views {r.layout}, " + ("one [L, B, page] view; " if r.stacked else "not one [L, B, page] view; ")
             + (f"{r.mismatched} of {r.pages} pages differ" if r.mismatched else f"{r.pages} pages bit-exact"))
            for r in report.round_trips]
    for r in report.races:
        if r.followed:
            out.append(("load after a busy compute stream", "ok" if r.ok else "FAIL",
                        f"{r.pages} zeroed pages read back as stored" if r.ok
                        else f"{r.mismatched} of {r.pages} pages not as stored"))
        else:
            out.append(("  same load without follow_compute", "info",
                        f"race observed: {r.mismatched} of {r.pages} pages not as stored" if r.mismatched
                        else "race not observed (the copy ran after the zeroing anyway)"))
    if (s := report.syncs) is not None:
        out += [(f"host syncs per {kind} ({s.chunks} chunks)", "info",
                 "n/a (no sync debug mode on a CPU)" if n is None else f"{n} (torch sync debug mode)")
                for kind, n in (("load", s.load), ("save", s.save))]
        out.append(("save claims that waited", "info", f"{s.save_waits} of {s.chunks}"))
    out += [(f"{t.direction} {t.tokens} tokens ({_size(t.nbytes)})", "met" if t.ratio >= RATE_TARGET else "not met",
             f"kvtier {t.nbytes / t.kvtier_s / 1e9:.1f} GB/s, torch copy_ {t.nbytes / t.torch_s / 1e9:.1f} GB/s: "
             f"{t.ratio:.2f} (target >= {RATE_TARGET})") for t in report.timings]
    return out + [(check, "FAIL", error) for check, error in report.errors]


def exit_code(report: Report) -> int:
    """1 on an exception, on views not in one lbhnc allocation, on a mismatch of a round trip or of the
    ordered load; else 0."""
    checked = report.round_trips + [r for r in report.races if r.followed]
    return 1 if report.errors or not all(c.ok for c in checked) else 0


def print_table(report: Report) -> None:
    """With rich when it is installed (a GPU machine may have torch alone), else plain aligned text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        table = rows(report)
        widths = [max(len(r[i]) for r in table) for i in range(2)]
        print("kvtier GPU check")
        for check, status, detail in table:
            print(f"{check:<{widths[0]}}  {status:<{widths[1]}}  {detail}")
        return
    colour = {"ok": "green", "met": "green", "FAIL": "red", "not met": "yellow", "info": "cyan"}
    table = Table("check", "result", "detail", title="kvtier GPU check")
    for check, status, detail in rows(report):
        table.add_row(check, f"[{colour[status]}]{status}[/]" if status else "", detail)
    Console().print(table)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Shape]:
    p = argparse.ArgumentParser(prog="python -m kvtier.transfer.gpu_check",
                                description="Check kvtier's KV block copies on one GPU (no vLLM needed).")
    p.add_argument("--device", help="torch device (default: cuda; cpu runs the same checks on the CPU)")
    p.add_argument("--small", action="store_true", help="a small cache and a 256-token load (tests)")
    p.add_argument("--chunk-tokens", type=int, help="tokens per chunk (default 256)")
    p.add_argument("--tokens", type=int, help="tokens per load and save (default 8192)")
    p.add_argument("--num-blocks", type=int, help="blocks of the cache (default 1024)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per transfer (median; default 5)")
    p.add_argument("--fp8", choices=sorted(FP8_DTYPES), default=DEFAULT_FP8,
                   help=f"the fp8 cache's dtype (default {DEFAULT_FP8})")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("chunk_tokens", args.chunk_tokens), ("load_tokens", args.tokens),
                                   ("num_blocks", args.num_blocks)) if v is not None}
    shape = replace(SMALL if args.small else Shape(), **overrides)
    try:
        shape.validate()
    except ValueError as e:
        p.error(str(e))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args, shape


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks and print the table; returns the exit code (2: no CUDA device)."""
    args, shape = parse_args(argv)
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda or 'not built'}) sees none; "
              "`python -m kvtier.transfer.gpu_check --device cpu` runs the same checks on the CPU", file=sys.stderr)
        return 2
    report = run_checks(shape, device, FP8_DTYPES[args.fp8], args.repeats)
    print_table(report)
    return exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
