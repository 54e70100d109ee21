"""Which of a request's stored chunks to claim: the prefix whose load is expected to finish before
computing it would (``claims.policy: pays-off``), or all of them (``always``).

Pure and typed (no vLLM, no I/O): the scheduler (``claim_gate.py``) hands ``decide`` the chunks it
could claim, in prompt order, each with the tier holding it, the bytes its read moves and the tokens
it saves from being computed; the tiers' read speeds measured by the worker
(``kvtier.read_speed.TierSpeed``); the engine's prefill cost (``PrefillCost``); and per tier a cost
paid once if any of its chunks is claimed (``fixed_s``: the shared tier's existence query, when it
has not been asked yet).

Claiming the first m chunks is expected to cost

    load(m)    = sum over tiers t among them: fixed_s[t] + ceil(count_t / reads_in_flight(t)) x read_s(t)
    compute(m) = sum over those chunks [start, end): per_token_s (end - start) + quadratic_s (end^2 - start^2)

(reads are issued ``reads_in_flight`` at a time, so a tier's chunks cost whole rounds of reads). The
claim is the m with the largest expected saving ``margin x compute(m) - load(m)`` (the smallest such
m on ties; 0 when no prefix saves anything). A chain is a prefix (a chunk's KV is useless without its
predecessors), so m also never passes a chunk whose tier is unavailable (it failed a read recently:
timeout, backend down, breaker open).

Declined chunks are counted per (tier, reason): the first one after the claim ``unavailable`` (its
tier is) or ``slow`` (claiming it too would not pay off), every later one ``after_declined``.

Nothing is declined on no evidence: a tier whose estimate is not trusted (fewer than
``min_samples`` of decayed reads: never read, or its estimate faded) loads for free in this sum, and an
unknown prefill cost claims everything (up to an unavailable tier): today's behaviour, and how a
slow tier gets measured again.

Guarantees (tests/unit/test_claim_policy.py, hypothesis): the claim is a prefix with
``load(m) <= margin x compute(m)`` and no prefix saves more; a faster tier never claims fewer chunks;
a larger margin never claims fewer; every chunk is claimed or counted once in ``declined``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kvtier.read_speed import TierSpeed

SLOW = "slow"
UNAVAILABLE = "unavailable"
AFTER_DECLINED = "after_declined"
REASONS = (SLOW, UNAVAILABLE, AFTER_DECLINED)


@dataclass(frozen=True)
class ChunkLoad:
    """One chunk the scheduler could claim: ``tier`` holds it, reading it moves ``nbytes`` (0: the
    tier's usual read size), loading it saves computing tokens ``[start, end)``."""

    tier: str
    nbytes: int
    start: int
    end: int


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to compute ``new`` tokens after ``context`` cached ones:
    ``per_token_s * new + quadratic_s * ((context + new)^2 - context^2)`` (the calibration's
    ``b n + c n^2`` without its fixed term, ``kvtier.demo.calibrate.PrefillProfile.extend_seconds``)."""

    per_token_s: float
    quadratic_s: float = 0.0

    def extend_s(self, context: int, new: int) -> float:
        ctx, new = max(0, context), max(0, new)
        return self.per_token_s * new + self.quadratic_s * ((ctx + new) ** 2 - ctx ** 2)


@dataclass(frozen=True)
class ClaimRule:
    """The policy's settings (``claims`` in the config) and the loads' reads in flight per tier."""

    margin: float = 1.0
    min_samples: float = 1.5
    reads_in_flight: Mapping[str, int] = field(default_factory=dict)
    default_in_flight: int = 2

    def in_flight(self, tier: str) -> int:
        return max(1, self.reads_in_flight.get(tier, self.default_in_flight))


@dataclass
class ClaimDecision:
    """``claimed``: leading chunks to claim; ``declined``: (tier, reason) -> chunks; per prefix of
    1..k chunks considered, its expected load and compute seconds (cumulative; ``compute_s`` None:
    the prefill cost is unknown)."""

    claimed: int
    declined: Counter = field(default_factory=Counter)
    load_s: list = field(default_factory=list)
    compute_s: list = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        """Why the claim stopped (None: every chunk claimed)."""
        first = [r for (_, r) in self.declined if r != AFTER_DECLINED]
        return first[0] if first else None


def decide(chunks: Sequence[ChunkLoad], speeds: Mapping[str, TierSpeed], cost: PrefillCost | None,
           rule: ClaimRule, fixed_s: Mapping[str, float] | None = None) -> ClaimDecision:
    """The leading chunks to claim and, per (tier, reason), the chunks declined; side-effect free."""
    fixed = fixed_s or {}
    hard = next((i for i, ch in enumerate(chunks)
                 if (sp := speeds.get(ch.tier)) is not None and sp.unavailable_s > 0), len(chunks))
    out = ClaimDecision(0)
    if cost is None:
        out.claimed = hard
    else:
        load = compute = best = 0.0
        count: Counter = Counter()
        for i, ch in enumerate(chunks[:hard]):
            compute += cost.extend_s(ch.start, ch.end - ch.start)
            sp = speeds.get(ch.tier)
            if sp is not None and sp.trusted(rule.min_samples):
                if count[ch.tier] == 0:
                    load += fixed.get(ch.tier, 0.0)
                if count[ch.tier] % rule.in_flight(ch.tier) == 0:    # this chunk opens a round of reads
                    load += sp.read_s(ch.nbytes)
                count[ch.tier] += 1
            out.load_s.append(load)
            out.compute_s.append(compute)
            if rule.margin * compute - load > best:
                best, out.claimed = rule.margin * compute - load, i + 1
    for i, ch in enumerate(chunks[out.claimed:], start=out.claimed):
        reason = AFTER_DECLINED if i > out.claimed else UNAVAILABLE if i == hard else SLOW
        out.declined[(ch.tier, reason)] += 1
    return out
