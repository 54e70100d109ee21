"""The companion demo's size search: candidate sizes, their workloads, estimates and regimes, memoised.

``kvtier.demo.sizing.size_companion`` decides *which* size to run; this module answers the questions
it asks about one candidate: the workload a (length scale g, reply scale r, conversations C, users U)
generates, its estimated wall time (``kvtier.demo.sizing.estimate``), its capacities read off the
miss-ratio curve (``kvtier.demo.regime.size_curve``, once per size; ``regime_on`` adds the TTFT
model) and whether it reaches the published regime. Generating and tokenizing a workload is what costs (about 17 ms a
conversation with the real tokenizer); everything is memoised by (g, r, C[, U]), so the policy can ask
freely. ``cheapest_in_regime`` is the search for when the largest sizes under the target miss the
regime: the cheapest size found that reaches it, at any length scale, under the target or not (its
estimate says by how much the target is missed). Side-effect free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvtier.demo.calibrate import PrefillProfile

#: (length scale g, reply scale r)
Shape = tuple[float, float]


@dataclass
class SizeSearch:
    """Candidate sizes of ``base`` on a machine (``profile``, a server's ``startup_s``); ``facts_of``
    generates a size's ``WorkloadFacts``; ``users`` fixes the interleaving (``--users``)."""

    base: Any
    profile: PrefillProfile
    startup_s: float
    target_s: float
    facts_of: Callable[[Any], Any]
    history: str = "live"
    users: int | None = None                # --users: the only interleaving
    conversations: int | None = None        # --conversations: the only conversation count
    _sizes: dict[tuple[float, float, int], tuple[Any, Any]] = field(default_factory=dict, repr=False)
    _curve: dict[tuple[float, float, int, int], Any] = field(default_factory=dict, repr=False)
    _full: dict[tuple[float, float, int, int], Any] = field(default_factory=dict, repr=False)
    _total: dict[tuple[float, float, int, int], float] = field(default_factory=dict, repr=False)

    @property
    def speed(self) -> float:
        return self.profile.speed_factor()

    def shapes(self, scales: Sequence[float]) -> list[Shape]:
        """(g, r) for each g, r longest first, skipping an r whose replies round to a longer one's."""
        from kvtier.demo.sizing import REPLY_SCALES, scaled

        out: list[Shape] = []
        for g in scales:
            seen: set[int] = set()
            for r in REPLY_SCALES:
                reply = scaled(self.base, g, self.speed * g, self.base.conversations, r).assistant_tokens
                if reply not in seen:
                    seen.add(reply)
                    out.append((g, r))
        return out

    def make(self, gr: Shape, c: int, u: int) -> tuple[Any, Any]:
        """(size, its WorkloadFacts) at g, r with ``c`` conversations and ``u`` users."""
        from kvtier.demo.sizing import MAX_CONVERSATIONS, scaled

        c = max(1, min(MAX_CONVERSATIONS, c))
        if (*gr, c) not in self._sizes:
            size = scaled(self.base, gr[0], self.speed * gr[0], c, gr[1])
            self._sizes[(*gr, c)] = size, self.facts_of(size)
        size, f = self._sizes[(*gr, c)]
        users = u if self.users is not None else max(1, min(u, c))
        return dataclasses.replace(size, concurrency=users), f

    def _key(self, gr: Shape, c: int, u: int) -> tuple[float, float, int, int]:
        from kvtier.demo.sizing import MAX_CONVERSATIONS

        return (*gr, max(1, min(MAX_CONVERSATIONS, c)), u)

    def _size_curve(self, gr: Shape, c: int, u: int) -> Any:
        """The size's curve in send order and the curve-alone capacities (``regime.size_curve``), once
        per size: both regimes below start from it."""
        from kvtier.demo.regime import size_curve

        key = self._key(gr, c, u)
        if key not in self._curve:
            self._curve[key] = size_curve(*self.make(gr, c, u), self.profile, self.history)
        return self._curve[key]

    def curve_regime(self, gr: Shape, c: int, u: int) -> Any:
        """The capacities from the curve alone (no TTFT model): cheap, for the search's estimates."""
        return self._size_curve(gr, c, u).chosen

    def regime(self, gr: Shape, c: int, u: int) -> Any:
        """The capacities with the TTFT model (RAM sized by its predicted speedup): the regime that runs."""
        from kvtier.demo.regime import regime_on

        key = self._key(gr, c, u)
        if key not in self._full:
            self._full[key] = regime_on(self._size_curve(gr, c, u), *self.make(gr, c, u), self.profile)
        return self._full[key]

    def total(self, gr: Shape, c: int, u: int) -> float:
        """Estimated wall time of the whole demo at this size (capacities from the curve alone)."""
        from kvtier.demo.sizing import estimate

        key = self._key(gr, c, u)
        if key not in self._total:
            size, f = self.make(gr, c, u)
            self._total[key] = estimate(self.profile, self.startup_s, size, f, self.history,
                                        self.curve_regime(gr, c, u))[0]
        return self._total[key]

    def could_reach(self, gr: Shape, c: int, u: int) -> bool:
        """The curve alone already rules out vanilla's or RAM+SSD's point (the TTFT model only moves RAM)."""
        return all(p.startswith("RAM-only") for p in self.curve_regime(gr, c, u).problems)

    def replies_long_enough(self, gr: Shape, c: int, u: int) -> bool:
        """Live history sends each turn's own reply length: its mean must be a chat's
        (``sizing.MIN_MEAN_REPLY_TOKENS``)."""
        from kvtier.demo.sizing import MIN_MEAN_REPLY_TOKENS

        mean = self.make(gr, c, u)[1].mean_reply_tokens
        return self.history != "live" or mean is None or mean >= MIN_MEAN_REPLY_TOKENS

    def reaches(self, gr: Shape, c: int, u: int) -> bool:
        return (c >= 1 and self.replies_long_enough(gr, c, u) and self.could_reach(gr, c, u)
                and self.regime(gr, c, u).reached)

    def first_reached(self, gr: Shape, u: int, cs: Sequence[int]) -> int | None:
        return next((c for c in cs if self.reaches(gr, c, u)), None)

    def under(self, gr: Shape, u: int) -> int:
        """The most conversations whose estimate fits the target at (g, r) and ``u`` users; 0 if none."""
        from kvtier.demo.sizing import MAX_CONVERSATIONS

        if self.conversations is not None:
            return self.conversations if self.total(gr, self.conversations, u) <= self.target_s else 0
        return largest_under(lambda c: self.total(gr, c, u), self.target_s, self.base.conversations,
                             MAX_CONVERSATIONS)

    def cheapest_in_regime(self, scales: Sequence[float], user_candidates: Sequence[int], max_conversations: int,
                           neighbours: int) -> tuple[float, Shape, int, int] | None:
        """(estimate s, (g, r), C, U) of the cheapest size found that reaches the regime, or None.

        Length scales smallest first (a longer prompt costs more time); at the first g where any (r, U, C)
        reaches it, the one with the smallest estimate. Per (g, r, U), C from just above the most that fit
        the target (``under``: its next ``neighbours``, twice and four times it) and from the interleaving
        (U to U + ``neighbours`` - 1, 2U, 4U, 8U: a returning turn's reuse distance grows with the
        conversations in flight), up to ``max_conversations``; the smallest C that reaches the regime."""
        for g in sorted(set(scales)):
            options = []
            for gr in self.shapes([g]):
                for u in user_candidates:
                    if self.conversations is not None:
                        cs = [self.conversations]
                    else:
                        lo = max(1, self.under(gr, u))
                        cs = sorted(c for c in {*range(lo + 1, lo + 1 + neighbours), *range(u, u + neighbours),
                                                2 * lo, 4 * lo, 2 * u, 4 * u, 8 * u} if c <= max_conversations)
                    hit = self.first_reached(gr, u, cs)
                    if hit is not None:
                        options.append((self.total(gr, hit, u), gr, hit, u))
            if options:
                return min(options)
        return None


def largest_under(fn: Callable[[int], float], target: float, start: int, most: int) -> int:
    """Largest C in [1, ``most``] with fn(C) <= target (fn grows with C); 0 if none."""
    lo, hi = 0, None
    c = max(1, start)
    while True:                      # bracket: double or halve from the base size
        if fn(c) <= target:
            lo = c
            if c >= most:
                return c
            nxt = min(most, c * 2)
            if hi is not None and nxt >= hi:
                break
            c = nxt
        else:
            hi = c
            if c == 1:
                return 0
            if lo:
                break
            c = max(1, c // 2)
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fn(mid) <= target else (lo, mid)
    return lo
