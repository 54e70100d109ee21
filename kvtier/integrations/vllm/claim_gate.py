"""The scheduler's claim gate: what it knows of the tiers' and the engine's speeds, and the decision
of ``claim_policy`` applied to one request's chunks.

- Tier read speeds arrive from the worker (``KvtierWorkerMetadata.read_speeds``) and are aged here
  by the time since they arrived (``claims.half_life_s``), so a tier the scheduler stopped claiming
  from fades back to "untrusted" and is claimed (measured) again.
- Prefill cost: the worker times each forward pass (``KvtierWorkerMetadata.forward``: tokens, attention
  span, seconds); seconds per unit of work (``PrefillCost.units``, shape ``quadratic_ratio``) are a
  decayed mean (``UnitSpeed``). Until ``min_samples`` passes back it, the configured calibration
  (``claims.prefill_per_token_s``) is used, and without one the cost is unknown (everything is claimed).
  Forward passes are robust where step times are not: they exclude the synchronous load, the
  scheduler's own work and idle time between steps.
- The shared tier's existence query is timed here, on the lookup thread (``timed_query``): before the
  query is asked, its expected time is part of the shared chunks' load (``fixed_s``); once answered it
  is paid and no longer counts.

No I/O, no vLLM; ``cut`` is side-effect free except for the DEBUG log line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvtier.integrations.vllm.claim_policy import ChunkLoad, ClaimDecision, ClaimRule, PrefillCost, decide
from kvtier.read_speed import TierSpeed, UnitSpeed

if TYPE_CHECKING:
    from kvtier.config import ClaimsConfig

log = logging.getLogger("kvtier.connector")

#: prefill cost shape when no calibration is configured: quadratic_s / per_token_s measured for the
#: bundled model (kvtier calibrate, AVX2: c / b = 1.0e-6 / 4.05e-3)
DEFAULT_QUADRATIC_RATIO = 2.5e-4
#: decayed weight of existence queries behind their estimate (one query, for a half-life)
QUERY_MIN_SAMPLES = 0.5
#: the tier whose read speed stands for a directory entry of unknown tier (the worker's RAM)
_SPEED_TIER = {"worker": "memory"}


class ClaimGate:
    def __init__(self, claims: "ClaimsConfig", *, chunk_size: int, chunk_nbytes: int = 0, async_read_depth: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pays_off = claims.policy == "pays-off"
        self.half_life_s = claims.half_life_s
        self.chunk_size = chunk_size
        self.chunk_nbytes = chunk_nbytes
        self.rule = ClaimRule(margin=claims.margin, min_samples=claims.min_samples,
                              reads_in_flight={"shared": async_read_depth})
        self._clock = clock
        self._speeds: dict[str, tuple[TierSpeed, float]] = {}
        self._prefill = UnitSpeed(half_life_s=5 * claims.half_life_s, clock=clock)
        self._query = UnitSpeed(alpha=0.1, half_life_s=claims.half_life_s, clock=clock)
        prior, quad = claims.prefill_per_token_s, claims.prefill_quadratic_s
        self.quadratic_ratio = quad / prior if prior and quad is not None else DEFAULT_QUADRATIC_RATIO
        self._prior_cost = PrefillCost(prior, prior * self.quadratic_ratio) if prior else None

    # -- what the worker reports ------------------------------------------------------------------
    def on_speeds(self, speeds: dict[str, TierSpeed]) -> None:
        now = self._clock()
        self._speeds.update({tier: (sp, now) for tier, sp in speeds.items()})

    def on_forward(self, tokens: int, span: int, seconds: float) -> None:
        """The worker timed a forward pass of ``tokens`` tokens (``span``: their attention work)."""
        self._prefill.record(tokens + self.quadratic_ratio * span, seconds)

    def timed_query(self, query: Callable[[Sequence[Any], Any], Any]) -> Callable[[Sequence[Any], Any], Any]:
        """``query`` (the store's ``shared_prefix``), timed into the existence-query estimate."""
        def timed(keys: Sequence[Any], deadline: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return query(keys, deadline)
            finally:
                self._query.record(1.0, time.perf_counter() - t0)
        return timed

    def query_s(self) -> float:
        """Expected seconds of one shared-tier existence query: one query measured within about a
        half-life is enough (there is one per request, fewer than reads); 0 once faded or never measured."""
        return self._query.seconds_per_unit(QUERY_MIN_SAMPLES) or 0.0

    # -- estimates --------------------------------------------------------------------------------
    def speeds(self) -> dict[str, TierSpeed]:
        """The worker's latest read-speed estimates, aged by the time since they arrived."""
        now = self._clock()
        out = {}
        for tier, (sp, t) in self._speeds.items():
            age = max(0.0, now - t)
            out[tier] = replace(sp, weight=sp.weight * 0.5 ** (age / self.half_life_s),
                                unavailable_s=max(0.0, sp.unavailable_s - age))
        return out

    def prefill_cost(self) -> PrefillCost | None:
        spu = self._prefill.seconds_per_unit(self.rule.min_samples)
        if spu is None:
            return self._prior_cost
        return PrefillCost(spu, spu * self.quadratic_ratio)

    # -- the decision -------------------------------------------------------------------------------
    def chunks(self, tiers: Sequence[str], start: int, end: int) -> list[ChunkLoad]:
        """The chunks covering tokens ``[start, end)``, ``tiers[i]`` holding chunk i."""
        c = self.chunk_size
        return [ChunkLoad(_SPEED_TIER.get(tiers[ci], tiers[ci]) if ci < len(tiers) else "unknown",
                          self.chunk_nbytes, max(start, ci * c), min(end, (ci + 1) * c))
                for ci in range(start // c, -(-end // c))]

    def cut(self, req_id: str, tiers: Sequence[str], start: int, end: int,
            ask_shared: bool = False) -> tuple[int, ClaimDecision]:
        """Tokens ``[start, end)`` held by ``tiers`` (one per chunk from chunk 0): the end of the claim
        that pays off (a chunk boundary, or ``end`` when every chunk does) and the decision.
        ``ask_shared``: the shared tier's existence query is still to be paid."""
        chunks = self.chunks(tiers, start, end)
        speeds, cost = self.speeds(), self.prefill_cost()
        fixed = {"shared": self.query_s()} if ask_shared else {}
        d = decide(chunks, speeds, cost, self.rule, fixed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kvtier: claim %s%s: %d of %d chunks from token %d (%s); per prefix (last tier, load s, "
                      "compute s): %s; speeds (latency s, MB/s, weight, unavailable s): %s; prefill %s; "
                      "query %s; margin %.2f", req_id, " (before asking the shared tier)" if ask_shared else "",
                      d.claimed, len(chunks), start, d.reason or "all pay off",
                      [(ch.tier, _r(ld), _r(cp)) for ch, ld, cp in zip(chunks, d.load_s, d.compute_s)],
                      {t: (_r(sp.latency_s), _r(sp.bytes_per_s / 1e6), _r(sp.weight), _r(sp.unavailable_s))
                       for t, sp in speeds.items()}, cost, fixed, self.rule.margin)
        if d.claimed == len(chunks):
            return end, d
        return min(end, (start // self.chunk_size + d.claimed) * self.chunk_size), d


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
