"""Live speed estimates: how fast each tier's reads are in this process, and how fast the engine
computes prefill. Inputs of the claim policy (``kvtier.integrations.vllm.claim_policy``).

``ReadSpeeds`` (thread-safe; one per worker): every chunk read the worker makes is recorded with its
tier, bytes and seconds; per tier a decaying estimate of the per-call latency and the bandwidth
(``TierSpeed``: ``read_s(nbytes) = latency_s + nbytes / bytes_per_s``). Samples decay twice: by count
(each new sample scales the older ones by ``1 - alpha``, so the estimate follows the last ~1/alpha
reads) and by age (a sample's weight halves every ``half_life_s``). ``TierSpeed.weight`` is what is
left of the evidence (the samples' count, halved every half-life): an estimate below ``min_samples``
of it is not trusted (``trusted``) and the policy then claims as if the tier were fast, so a tier
declined for being slow is measured again once its estimate has faded (one load per few
half-lives), and a tier that recovered is noticed. A read the tier could
not answer (timeout, backend down, breaker open) marks it unavailable for ``unavailable_s``.

Latency and bandwidth are told apart only by reads of different sizes (a weighted least squares
over the decayed sums); with reads of one size (whole chunks), the latency is the prior
``prior_latency_s`` (capped at the mean read time) and the bandwidth is what remains.

``UnitSpeed``: decayed seconds per unit of work. The scheduler keeps two: the engine's forward
passes as measured by the worker, each with its work in units of the prefill cost model
(``claim_policy.PrefillCost``: a token plus ``quadratic_ratio`` x its attention span), and the
shared tier's existence queries (one unit each).

Side-effect free constructors; no I/O; nothing here imports torch or vLLM.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

#: read sizes whose variance is below this fraction of the squared mean size count as one size
_FLAT = 1e-6


@dataclass(frozen=True)
class TierSpeed:
    """One tier's reads as seen recently: ``read_s(n) = latency_s + n / bytes_per_s``; ``weight``: the
    decayed sample weight behind it; ``unavailable_s``: seconds it stays declined for failing (0: ok).
    Plain floats: it travels worker -> scheduler in the worker metadata."""

    latency_s: float
    bytes_per_s: float
    weight: float
    mean_bytes: float
    unavailable_s: float = 0.0

    def read_s(self, nbytes: float | None = None) -> float:
        n = self.mean_bytes if nbytes is None or nbytes <= 0 else float(nbytes)
        return self.latency_s + n / self.bytes_per_s if self.bytes_per_s > 0 else float("inf")

    def trusted(self, min_samples: float) -> bool:
        return self.weight >= min_samples


class _Decayed:
    """Decayed sums of (x, y) samples: weight, x, y, x^2, xy (decayed by count and age), and ``n``, the
    samples decayed by age only (how much evidence is left)."""

    __slots__ = ("w", "x", "y", "xx", "xy", "n", "t")

    def __init__(self, now: float) -> None:
        self.w = self.x = self.y = self.xx = self.xy = self.n = 0.0
        self.t = now

    def decay(self, now: float, half_life_s: float, keep: float = 1.0) -> None:
        age = 0.5 ** (max(0.0, now - self.t) / half_life_s) if half_life_s > 0 else 1.0
        f = keep * age
        self.w, self.x, self.y, self.xx, self.xy = self.w * f, self.x * f, self.y * f, self.xx * f, self.xy * f
        self.n *= age
        self.t = max(self.t, now)

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        self.n += weight
        self.w += weight
        self.x += weight * x
        self.y += weight * y
        self.xx += weight * x * x
        self.xy += weight * x * y


class ReadSpeeds:
    def __init__(self, *, alpha: float = 0.1, half_life_s: float = 60.0, prior_latency_s: float = 0.0,
                 unavailable_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.half_life_s = half_life_s
        self.prior_latency_s = prior_latency_s
        self.unavailable_for_s = unavailable_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sums: dict[str, _Decayed] = {}
        self._down_until: dict[str, float] = {}
        self.version = 0                      # bumped by every record / failure (report only on change)

    def record(self, tier: str, nbytes: int, seconds: float) -> None:
        """One read of ``nbytes`` from ``tier`` that took ``seconds`` (a hit: verified bytes)."""
        if nbytes <= 0 or seconds < 0:
            return
        now = self._clock()
        with self._lock:
            s = self._sums.get(tier)
            if s is None:
                s = self._sums[tier] = _Decayed(now)
            s.decay(now, self.half_life_s, 1.0 - self.alpha if s.w > 0 else 1.0)
            s.add(float(nbytes), float(seconds))
            self._down_until.pop(tier, None)
            self.version += 1

    def failed(self, tier: str) -> None:
        """A read ``tier`` could not answer (timeout, backend down, breaker open)."""
        with self._lock:
            self._down_until[tier] = self._clock() + self.unavailable_for_s
            self.version += 1

    def get(self, tier: str) -> TierSpeed | None:
        with self._lock:
            return self._speed(tier, self._clock())

    def snapshot(self) -> dict[str, TierSpeed]:
        """Every tier with samples or a recent failure."""
        with self._lock:
            now = self._clock()
            out = {}
            for tier in set(self._sums) | set(self._down_until):
                sp = self._speed(tier, now)
                if sp is not None:
                    out[tier] = sp
            return out

    def _speed(self, tier: str, now: float) -> TierSpeed | None:
        down = max(0.0, self._down_until.get(tier, 0.0) - now)
        s = self._sums.get(tier)
        if s is None or s.w <= 0:
            return TierSpeed(0.0, 0.0, 0.0, 0.0, down) if down > 0 else None
        age = 0.5 ** (max(0.0, now - s.t) / self.half_life_s) if self.half_life_s > 0 else 1.0
        mx, my = s.x / s.w, s.y / s.w
        var = s.xx / s.w - mx * mx
        latency = None
        if var > _FLAT * mx * mx:                           # reads of several sizes: fit both
            slope = (s.xy / s.w - mx * my) / var            # seconds per byte
            if slope > 0:
                latency = my - slope * mx
        if latency is None or latency < 0:
            latency = min(self.prior_latency_s, my)
        rest = my - latency
        bw = mx / rest if rest > 0 else float("inf")
        return TierSpeed(latency, bw, s.n * age, mx, down)


def fold(a: TierSpeed, b: TierSpeed) -> TierSpeed:
    """Two ranks' estimates of one tier (tensor parallel): the slower one counts, and so does a failure."""
    slow = a if a.read_s() >= b.read_s() else b
    return TierSpeed(slow.latency_s, slow.bytes_per_s, min(a.weight, b.weight), slow.mean_bytes,
                     max(a.unavailable_s, b.unavailable_s))


class UnitSpeed:
    """Decayed seconds per unit of work (``record(units, seconds)``), e.g. of the engine's forward passes."""

    def __init__(self, *, alpha: float = 0.2, half_life_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._s = _Decayed(clock())

    def record(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        with self._lock:
            self._s.decay(self._clock(), self.half_life_s, 1.0 - self.alpha if self._s.w > 0 else 1.0)
            self._s.add(units, seconds)

    def seconds_per_unit(self, min_samples: float) -> float | None:
        """None until ``min_samples`` of decayed weight back the estimate."""
        with self._lock:
            s, now = self._s, self._clock()
            age = 0.5 ** (max(0.0, now - s.t) / self.half_life_s) if self.half_life_s > 0 else 1.0
            if s.n * age < min_samples or s.x <= 0:
                return None
            return s.y / s.x
