"""FaultyTier: wrap any tier and inject faults into it — a drill tool for tests and users.

Configured as ``store.faults`` (``kvtier.config.FaultyConfig``): ``{wraps: memory|disk|shared,
latency_ms, error_rate, corrupt_rate, stall_after, stall_s, seed}``. The wrapper implements
the whole ``Tier`` interface (per-key and batched calls) by delegating to the inner tier and,
per call, from one seeded schedule (same seed and call order, same faults):

* **latency** — ``latency_ms`` is slept before every read and every batched lookup of a
  tier without a complete in-memory index (writes are not slowed: a slow write path shows
  up as a full write queue, ``dropped_store``). A batched call sleeps at most
  until its deadline and then answers ``UNAVAILABLE("timeout")`` without touching the inner
  tier. Per-key ``contains`` (an in-memory index check) is never slowed.
* **errors** — with probability ``error_rate`` a call fails as an I/O error would: reads
  miss (per key) or are ``UNAVAILABLE("io_error")`` (batched), lookups answer "absent" /
  ``UNAVAILABLE``, writes are refused (``False``; payloads released, ``on_done(key, False)``).
* **corruption** — with probability ``corrupt_rate`` a read's bytes are corrupted *before*
  verification: for a tier with chunk files (``path_of``, the disk tier) one byte of the
  file is flipped and the inner tier reads (and verifies) it — its own check must turn it
  into a miss and a counted event; for other tiers the chunk is re-encoded
  (``kvtier.chunk.encode``), one byte flipped and the blob verified with ``chunk.decode``:
  a detected corruption is a miss + the verifier's event; an undetected one would be copied
  into the caller's buffer (so a verification gap shows up as wrong data in the drill, it
  is never hidden).
* **stalls** — after ``stall_after`` data calls every data call sleeps ``stall_s`` (a hung
  backend; batched calls are cut at their deadline and answer ``UNAVAILABLE("timeout")``).

Every injected fault is counted in ``injected`` (by kind) and as a ``Telemetry.event``
logged once per burst (``kvtier.tiers.bursts``). Attributes the wrapper does not define
(backend extras such as the disk tier's ``submit``/``path_of``/``start_writers``, hooks the
store sets such as ``on_evict``) are read from / written to the inner tier.

Side-effect free construction: ``FaultyTier.wrap(inner, cfg, namespace, telemetry)``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from typing import Any, Callable, Sequence

from kvtier.chunk import ChunkError, ChunkMeta, decode, encode
from kvtier.config import FaultyConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier, WrappingTier, as_byte_view
from kvtier.tiers.bursts import Bursts
from kvtier.tiers.protocol import Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem

# attributes that live on the wrapper itself; everything else is the inner tier's
_OWN = frozenset({"inner", "cfg", "name", "capabilities", "injected", "calls", "_ns", "_tm", "_bursts",
                  "_rng", "_lock"})


class FaultyTier(WrappingTier):
    def __init__(self, inner: Tier, cfg: FaultyConfig, namespace_digest: bytes, telemetry: Telemetry) -> None:
        # no Tier.__init__: on_evict / evict_guard belong to the inner tier (set through __setattr__)
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "cfg", cfg)
        object.__setattr__(self, "name", inner.name)
        object.__setattr__(self, "capabilities", inner.capabilities)
        object.__setattr__(self, "injected", Counter())
        object.__setattr__(self, "calls", 0)
        object.__setattr__(self, "_ns", namespace_digest)
        object.__setattr__(self, "_tm", telemetry)
        object.__setattr__(self, "_bursts", Bursts(telemetry, inner.name))
        object.__setattr__(self, "_rng", random.Random(cfg.seed))
        object.__setattr__(self, "_lock", threading.Lock())

    @classmethod
    def wrap(cls, inner: Tier, cfg: FaultyConfig, namespace: Namespace, telemetry: Telemetry) -> "FaultyTier":
        return cls(inner, cfg, namespace.digest(), telemetry)

    # -- delegation of everything the wrapper does not define ---------------------------------
    def __getattr__(self, name: str) -> Any:          # only called when normal lookup fails
        return getattr(object.__getattribute__(self, "inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # -- the fault schedule --------------------------------------------------------------------
    def _draw(self) -> tuple[bool, bool, bool]:
        """One data call: (stall, error, corrupt) from the seeded schedule."""
        c = self.cfg
        with self._lock:
            object.__setattr__(self, "calls", self.calls + 1)
            stall = c.stall_after is not None and self.calls > c.stall_after
            error = c.error_rate > 0 and self._rng.random() < c.error_rate
            corrupt = c.corrupt_rate > 0 and self._rng.random() < c.corrupt_rate
        return stall, error, corrupt

    def _count(self, kind: str, event: str | None, detail: str) -> None:
        with self._lock:
            self.injected[kind] += 1
        if event is not None:
            self._bursts.fault(event, f"injected: {detail}")

    def _delay(self, stall: bool, deadline: Deadline | None) -> bool:
        """Sleep the injected latency (+ stall); False if the deadline cut it short."""
        want = self.cfg.latency_ms / 1000.0 + (self.cfg.stall_s if stall else 0.0)
        if stall:
            self._count("stall", None, "stall")
        if want <= 0:
            return True
        if deadline is None:
            time.sleep(want)
            return True
        left = deadline.remaining()
        time.sleep(min(want, left))
        return want <= left

    # -- reads -----------------------------------------------------------------------------------
    def _corrupt_read(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        """Corrupt the chunk before verification, then read it through the verifier."""
        path_of: Callable[[ChunkKey], str] | None = getattr(self.inner, "path_of", None)
        if path_of is not None:
            try:
                with open(path_of(key), "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size > 0:
                        pos = self._rng.randrange(size)
                        f.seek(pos)
                        b = f.read(1)
                        f.seek(pos)
                        f.write(bytes([b[0] ^ 0x5A]))
                        self._count("corrupt", None, f"flipped byte {pos} of {key.hex()[:16]}")
                        f.flush()
                        return self.inner.get_into(key, out)   # the inner tier verifies and counts
            except OSError:
                pass                                            # not a file (pending write): re-verify below
        got = self.inner.get(key)
        if got is None:
            return None
        meta, payload = got
        blob = bytearray(encode(self._ns, meta, payload))
        pos = self._rng.randrange(len(blob))
        blob[pos] ^= 0x5A
        self._count("corrupt", None, f"flipped byte {pos} of {key.hex()[:16]}")
        try:
            meta2, payload2 = decode(self._ns, blob, expect_key=key)
        except ChunkError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {e} (injected)")
            return None
        if len(out) < meta2.payload_len:
            raise ValueError("output buffer too small")
        out[:meta2.payload_len] = payload2                      # undetected: the drill shows it
        return meta2

    def _read_one(self, key: ChunkKey, out: memoryview, deadline: Deadline | None) -> ReadResult:
        stall, error, corrupt = self._draw()
        if not self._delay(stall, deadline):
            return ReadResult.unavailable("timeout")
        if error:
            self._count("io_error", "io_error", f"read {key.hex()[:16]}")
            return ReadResult.unavailable("io_error") if deadline is not None else ReadResult.miss("io_error")
        meta = self._corrupt_read(key, out) if corrupt else self.inner.get_into(key, out)
        return ReadResult.hit(meta) if meta is not None else ReadResult.miss("corrupt" if corrupt else "absent")

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        return self._read_one(key, as_byte_view(out, writable=True), None).meta

    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        stall, error, corrupt = self._draw()
        self._delay(stall, None)
        if error:
            self._count("io_error", "io_error", f"read {key.hex()[:16]}")
            return None
        got = self.inner.get(key)
        if got is None or not corrupt:
            return got
        buf = memoryview(bytearray(max(got[0].payload_len, 1)))
        meta = self._corrupt_read(key, buf)
        return None if meta is None else (meta, buf[:meta.payload_len])

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                  deadline: Deadline, *, lent: bool = False) -> list[ReadResult]:
        results: list[ReadResult] = []
        for key, out in zip(keys, outs):
            if deadline.expired():
                results.append(ReadResult.unavailable("timeout"))
            else:
                results.append(self._read_one(key, as_byte_view(out, writable=True), deadline))
        return results

    # -- lookups ---------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        if self.cfg.error_rate > 0:
            with self._lock:
                error = self._rng.random() < self.cfg.error_rate
            if error:
                self._count("lookup_error", "io_error", f"lookup {key.hex()[:16]}")
                return False
        return self.inner.contains(key)

    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        if self.inner.capabilities.complete_index:          # memory-only lookups are never slowed
            return Tier.longest_prefix(self, keys, deadline)
        stall, error, _ = self._draw()
        if not self._delay(stall, deadline):
            return PrefixResult(0, Status.UNAVAILABLE)
        if error:
            self._count("lookup_error", "io_error", f"lookup of {len(keys)} keys")
            return PrefixResult(0, Status.UNAVAILABLE)
        return self.inner.longest_prefix(keys, deadline)

    # -- writes ----------------------------------------------------------------------------------
    def _write_fails(self, key: ChunkKey) -> bool:
        stall, error, _ = self._draw()
        if stall:                                # writes get stalls and errors, not the read latency
            self._count("stall", None, "stall")
            time.sleep(self.cfg.stall_s)
        if error:
            self._count("write_error", "io_error", f"write {key.hex()[:16]}")
        return error

    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        return False if self._write_fails(meta.key) else self.inner.put(meta, payload)

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        fails = [self._write_fails(it.meta.key) for it in items]
        passed = [it for it, bad in zip(items, fails) if not bad]
        inner_ok = iter(self.inner.write(passed, on_done) if passed else [])
        accepted: list[bool] = []
        for it, bad in zip(items, fails):
            if bad:
                if it.release is not None:
                    it.release()
                if on_done is not None:
                    on_done(it.meta.key, False)
                accepted.append(False)
            else:
                accepted.append(next(inner_ok))
        return accepted
