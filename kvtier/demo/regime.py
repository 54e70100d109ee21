"""The companion demo's capacities, read off the workload's miss-ratio curve.

What decides a tier's hit rate is its capacity against the **reuse distance** of the returning
turns: the distinct tokens other requests touch between a conversation's consecutive turns (an LRU
cache of C tokens hits an access iff its stack distance is below C). Ratios of capacities to the
working set do not keep it: with few conversations in flight a chat comes back after a couple of
other turns, and a RAM tier holding 30% of the working set still serves 90% of the ideal.

So the demo computes, on the workload it will send, in the order the closed loop sends it
(``kvtier.demo.sizing.closed_loop_seconds`` with the calibration's service times), the token-level
LRU miss-ratio curve at the demo's chunk granularity (``kvtier.sim.stackdist``: exact stack
distances, prefix rule, vLLM's never-the-last-token rule), and puts the three capacities where the
curve gives the published regime:

* engine KV space (vanilla vLLM's own prefix cache, which also holds the running requests'
  blocks, the most recently used ones): the largest capacity whose predicted hit rate is at most
  ``VANILLA_TARGET``, never below one full-length request plus a block (vLLM refuses less);
* kvtier RAM: the RAM tier is **inclusive**: every chunk vLLM computes is written through to it, so
  it holds the most recently saved chunks, largely what vLLM's own prefix cache still holds. vLLM's
  hits come first; the RAM tier serves what it holds beyond them. So engine + RAM reach about one LRU
  tier of max(engine, RAM) tokens of distinct history, not of their sum (``inclusive_reach``): a RAM
  tier no larger than the engine's KV space adds next to nothing (a 2-vCPU AVX-512 run: engine 2,048
  tokens, RAM 1,792, predicted 22.3% as one LRU of their sum, measured 1.9%; the inclusive model
  says 4.2%, vanilla's own point, and vanilla measured 2.9%). RAM-only is read off its own curve
  (``regime_on``): kvtier's tiers and vLLM's block pool evict a chain from its tail, so a returning
  conversation keeps the part of its history the capacity still holds (``tail_first`` in
  ``kvtier.sim.stackdist``; plain LRU drops the head first and loses the whole prompt), and RAM-only's
  faster turns bring a conversation back sooner, so its curve is computed in the order it sends its
  turns at its own predicted hit rate. Both held on the recorded 2-vCPU AVX2 run of 2026-12-07: the
  engine's curve in one order (a run at half the ideal) said 31.4% for its 22-chunk RAM tier, the run
  measured 65.0%; its recorded reuse distances give 64.3% tail first and 52.4% plain, and the sizing
  now predicts 62.8% from its prompts. The engine's own point stays on the plain curve: its KV space
  also holds the running requests' blocks, which the tail-first curve does not take out (it said 7.8%
  for that run's vanilla, measured 3.3%; the plain curve 3.3%). RAM is sized on that model: with a
  ``speedup`` model (``regime_for``: the closed loop of ``kvtier.demo.closed_loop`` at each
  configuration's predicted hit rate), the smallest RAM whose predicted RAM-only mean-TTFT speedup
  reaches ``RAM_SPEEDUP_TARGET`` (the published ~1.4x), never past ``RAM_SHARE_MAX`` of the ideal;
  without one, the largest RAM whose hit rate is ``RAM_SHARE`` of the ideal;
* SSD: at least the capacity reaching ``SSD_SHARE`` of the ideal and 4x the working set of the
  workload's text (live history adds the replies' KV), i.e. the whole working set.

The interleaving: in a closed loop of U users, a conversation comes back after about U - 1 other
turns, each touching its own whole history, so reuse distances grow with U (users = conversations
in flight). ``user_candidates`` are the interleavings the sizing tries, fewest first.

The regime is *reached* when vanilla's predicted hit is at most ``VANILLA_MAX``, RAM-only's share
of the ideal at most ``RAM_SHARE_MAX`` (and, with a speedup model, its predicted speedup within
``RAM_SPEEDUP_RANGE``) and RAM+SSD's at least ``SSD_MIN_SHARE``. The predicted mean TTFT of each
configuration (``predicted_ttft``) shows what the saturated engine allows RAM+SSD (its queueing). ``choose_capacities``
is a pure function of the curve; ``regime_for`` computes the curve of a size. Side-effect free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import numpy as np

from kvtier.demo.curve_order import (CHUNK_TOKENS, curve_in_order, curves_in_order, send_order,  # noqa: F401
                                     synthetic_trace, workload_trace)
from kvtier.sim.stackdist import MissRatioCurve

VANILLA_TARGET = 0.04              # the published plain-vLLM hit rate is ~3%
VANILLA_MAX = 0.06                 # reached: 2 points of margin under the 8% the demo must show
RAM_SHARE = 0.33                   # RAM-only: a modest share of the ideal (published ~1.4x TTFT)
RAM_SHARE_MAX = 0.5
RAM_SPEEDUP_TARGET = 1.4           # the published RAM-only gain
RAM_SPEEDUP_RANGE = (1.2, 1.8)
SSD_SHARE = 0.95
SSD_MIN_SHARE = 0.90
MIN_RAM_CHUNKS = 2
#: RAM-only's send order: modelled at the share of the ideal it is predicted at, found in at most this
#: many rounds, to this tolerance (the cheap curve-alone choice orders the turns at the default share)
RAM_ORDER_ROUNDS = 4
RAM_ORDER_TOLERANCE = 0.05
DEFAULT_ORDER_SHARE = 0.5
SSD_WORKING_SETS = 4               # live history's replies add KV the workload's text does not have
MIN_SSD_CHUNKS = 64
#: users (conversations in flight) the sizing tries, as multiples of the base size's users
USER_STEPS = (1.0, 1.5, 2.0, 3.0, 4.0)
MAX_USERS = 48
CONFIGS = ("vanilla", "kvtier-ram", "kvtier-ram-ssd")


@dataclass(frozen=True)
class CurvePoint:
    """One chosen capacity: its tokens, the capacity of one LRU tier it is predicted as, and the
    curve's hit rate there."""

    tokens: int
    lru_tokens: int
    predicted_hit_rate: float
    share_of_ideal: float


@dataclass(frozen=True)
class Regime:
    """The curve (capacities in tokens, ascending; token hit rate at each) and the chosen points."""

    capacities_tokens: tuple[int, ...]
    hit_rate: tuple[float, ...]
    ideal_hit_rate: float
    engine: CurvePoint
    ram: CurvePoint
    ssd: CurvePoint
    floor_tokens: int                       # one full-length request + a block
    working_set_tokens: int
    users: int = 0
    returning_distance_median_tokens: float | None = None
    problems: tuple[str, ...] = ()
    #: (configuration, modelled mean TTFT s) at each predicted hit rate; empty without a speedup model
    predicted_ttft: tuple[tuple[str, float], ...] = ()
    #: the curve RAM-only is read off (``ram_curve``): chains evicted tail first, in RAM-only's own send
    #: order; empty: the curve above
    ram_capacities_tokens: tuple[int, ...] = ()
    ram_hit_rate: tuple[float, ...] = ()
    #: share of the ideal hit the send order of ``ram_hit_rate`` was modelled at
    ram_order_share: float | None = None

    @property
    def reached(self) -> bool:
        return not self.problems

    @property
    def predicted(self) -> dict[str, float]:
        return dict(zip(CONFIGS, (self.engine.predicted_hit_rate, self.ram.predicted_hit_rate,
                                  self.ssd.predicted_hit_rate)))

    @property
    def predicted_speedup(self) -> dict[str, float]:
        """Modelled mean-TTFT speedup of each configuration over vanilla (empty without a model)."""
        t = dict(self.predicted_ttft)
        base = t.get("vanilla")
        return {k: base / v for k, v in t.items() if base and v > 0}

    def at(self, tokens: float) -> float:
        """The curve's hit rate of one LRU tier of ``tokens``."""
        i = int(np.searchsorted(np.asarray(self.capacities_tokens), tokens, side="right")) - 1
        return float(self.hit_rate[i]) if i >= 0 else 0.0

    def ram_at(self, tokens: float) -> float:
        """RAM-only's curve at ``tokens`` (``ram_hit_rate``; the curve above when there is none)."""
        if not self.ram_capacities_tokens:
            return self.at(tokens)
        i = int(np.searchsorted(np.asarray(self.ram_capacities_tokens), tokens, side="right")) - 1
        return float(self.ram_hit_rate[i]) if i >= 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        pt = (lambda p: {"tokens": p.tokens, "lru_tokens": p.lru_tokens,
                         "predicted_hit_rate": p.predicted_hit_rate, "share_of_ideal": p.share_of_ideal})
        return {"reached": self.reached, "problems": list(self.problems), "users": self.users,
                "ideal_hit_rate": self.ideal_hit_rate, "floor_tokens": self.floor_tokens,
                "working_set_tokens": self.working_set_tokens,
                "returning_distance_median_tokens": self.returning_distance_median_tokens,
                "ram_model": "inclusive: engine + RAM reach max(engine, RAM) tokens of one LRU tier that evicts "
                             "chains tail first, in RAM-only's own send order",
                "ram_order_share": self.ram_order_share,
                "ram_curve": {"capacity_tokens": list(self.ram_capacities_tokens),
                              "token_hit_rate": list(self.ram_hit_rate)},
                "engine": pt(self.engine), "ram": pt(self.ram), "ssd": pt(self.ssd), "predicted": self.predicted,
                "predicted_ttft_s": dict(self.predicted_ttft), "predicted_speedup": self.predicted_speedup,
                "curve": {"capacity_tokens": list(self.capacities_tokens), "token_hit_rate": list(self.hit_rate)}}


def inclusive_reach(engine_chunks: int, ram_chunks: int) -> int:
    """Chunks of distinct history engine + an inclusive (write-through) RAM tier reach together: the
    larger of the two (the RAM tier holds the most recently saved chunks, the engine the most recently
    used; see the module docstring)."""
    return max(int(engine_chunks), int(ram_chunks))


def ram_only_hit_rate(curve: MissRatioCurve, engine_chunks: int, ram_chunks: int) -> float:
    """RAM-only's predicted token hit rate: vLLM's hits first, then the inclusive RAM tier's, i.e. the
    curve at ``inclusive_reach``."""
    return float(curve.at(inclusive_reach(engine_chunks, ram_chunks)))


def _largest_at_most(caps: np.ndarray, hits: np.ndarray, limit: float) -> int | None:
    """Largest capacity (chunks) whose hit rate is <= ``limit``; None if even the smallest is over,
    the curve's last capacity if it never passes it."""
    over = np.flatnonzero(hits > limit + 1e-12)
    if len(over) == 0:
        return int(caps[-1])
    return None if over[0] == 0 or caps[over[0]] <= 1 else int(caps[over[0]]) - 1


class TtftModel(Protocol):
    """Modelled mean TTFT of a run of the workload whose token hit rate is ``hit_rate``."""

    def ttft_s(self, hit_rate: float) -> float: ...


def _ram_by_speedup(caps: np.ndarray, curve: MissRatioCurve, engine: int,
                    speedup: Callable[[float], float]) -> int | None:
    """The smallest RAM (chunks, above the engine's) on the curve whose predicted RAM-only speedup
    reaches ``RAM_SPEEDUP_TARGET`` with a share of the ideal <= ``RAM_SHARE_MAX``; else the largest
    within that share (None when no capacity above the engine is within it). The speedup grows with
    the hit rate, so the distinct hit rates are bisected (a handful of model runs)."""
    ideal = curve.ideal_hit_rate
    cands: list[tuple[int, float]] = []
    for c in sorted({int(x) for x in caps if x > engine} | {int(x) - 1 for x in caps if x - 1 > engine}):
        h = ram_only_hit_rate(curve, engine, c)
        if ideal > 0 and h / ideal > RAM_SHARE_MAX + 1e-12:
            break
        if not cands or h > cands[-1][1] + 1e-12:
            cands.append((c, h))
    if not cands:
        return None
    lo, hi = 0, len(cands) - 1
    if speedup(cands[hi][1]) < RAM_SPEEDUP_TARGET:
        return cands[hi][0]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if speedup(cands[mid][1]) >= RAM_SPEEDUP_TARGET else (mid + 1, hi)
    return cands[lo][0]


def choose_capacities(curve: MissRatioCurve, *, floor_tokens: int, working_set_tokens: int,
                      chunk_tokens: int = CHUNK_TOKENS, users: int = 0,
                      returning_distance_median_tokens: float | None = None,
                      model: TtftModel | None = None, ram_curve: MissRatioCurve | None = None,
                      ram_order_share: float | None = None) -> Regime:
    """The three capacities on ``curve`` (capacities in chunks of ``chunk_tokens``); see the module
    docstring. ``model``: mean TTFT at a token hit rate (``regime_for`` builds it from the closed
    loop), or None. ``ram_curve``: the curve RAM-only is sized and predicted on (tail-first eviction in
    its own send order, ``ram_curve_at``); None: ``curve``. Pure: the same curves (and model) give the
    same choice."""
    caps, hits = np.asarray(curve.capacities_chunks), np.asarray(curve.hit_rate)
    rc = curve if ram_curve is None else ram_curve
    ideal = curve.ideal_hit_rate
    at = curve.at
    share = (lambda h: h / ideal if ideal > 0 else 0.0)
    problems: list[str] = []
    floor = -(-int(floor_tokens) // chunk_tokens)
    top = _largest_at_most(caps, hits, VANILLA_TARGET)
    engine = max(floor, top or 0)
    if top is not None and top >= caps[-1]:       # flat curve: no point in an engine above the working set
        engine = max(floor, -(-int(working_set_tokens) // chunk_tokens) // 4)
    e_hit = at(engine)
    if e_hit > VANILLA_MAX:
        problems.append(f"vanilla's engine KV space cannot go below {floor * chunk_tokens:,} tokens (one full "
                        f"request), where the curve predicts a {e_hit:.1%} hit rate (over {VANILLA_MAX:.0%})")
    base_ttft = model.ttft_s(e_hit) if model is not None else None
    speedup = (lambda h: base_ttft / max(1e-9, model.ttft_s(h))) if model is not None and base_ttft else None
    rcaps = np.asarray(rc.capacities_chunks)
    if speedup is not None:
        ram = _ram_by_speedup(rcaps, rc, engine, speedup)
    else:
        ram = _largest_at_most(rcaps, np.asarray(rc.hit_rate), RAM_SHARE * ideal)
    ram = max(MIN_RAM_CHUNKS, engine + 1 if ram is None or ram <= engine else ram)
    r_hit = ram_only_hit_rate(rc, engine, ram)
    if share(r_hit) > RAM_SHARE_MAX:
        problems.append(f"RAM-only is predicted at {share(r_hit):.0%} of the ideal hit rate even with "
                        f"{ram * chunk_tokens:,} tokens of RAM (over {RAM_SHARE_MAX:.0%})")
    knee = curve.smallest_reaching(SSD_SHARE)
    ssd = max(SSD_WORKING_SETS * -(-int(working_set_tokens) // chunk_tokens), MIN_SSD_CHUNKS, knee or 0, ram)
    s_hit = at(ssd)
    if share(s_hit) < SSD_MIN_SHARE:
        problems.append(f"RAM+SSD is predicted at only {share(s_hit):.0%} of the ideal hit rate")
    ttft: tuple[tuple[str, float], ...] = ()
    if model is not None and base_ttft:
        ttft = (("vanilla", base_ttft), ("kvtier-ram", model.ttft_s(r_hit)), ("kvtier-ram-ssd", model.ttft_s(s_hit)))
        lo, hi = RAM_SPEEDUP_RANGE
        r_sp = base_ttft / max(1e-9, ttft[1][1])
        if not lo <= r_sp <= hi and share(r_hit) <= RAM_SHARE_MAX:
            problems.append(f"RAM-only is predicted at {r_sp:.2f}x with {ram * chunk_tokens:,} tokens of RAM "
                            f"({share(r_hit):.0%} of the ideal), outside {lo}-{hi}x")
    point = (lambda t, lru, h: CurvePoint(t * chunk_tokens, lru * chunk_tokens, h, share(h)))
    ram_pts = ((), ()) if ram_curve is None else (tuple(int(c) * chunk_tokens for c in rcaps),
                                                  tuple(float(h) for h in rc.hit_rate))
    return Regime(tuple(int(c) * chunk_tokens for c in caps), tuple(float(h) for h in hits), ideal,
                  point(engine, engine, e_hit), point(ram, inclusive_reach(engine, ram), r_hit),
                  point(ssd, ssd, s_hit), floor * chunk_tokens, int(working_set_tokens), users,
                  returning_distance_median_tokens, tuple(problems), ttft, *ram_pts, ram_order_share)


def user_candidates(base_users: int, conversations: int | None = None) -> list[int]:
    """The interleavings (users) the sizing tries, fewest first; never more than ``conversations``."""
    out: list[int] = []
    for f in USER_STEPS:
        u = min(MAX_USERS, max(1, round(base_users * f)))
        if conversations is not None:
            u = min(u, conversations)
        if u not in out:
            out.append(u)
    return out


@dataclass(frozen=True)
class SizeCurve:
    """A size's curve in the closed loop's send order and the capacities chosen on it by the curve
    alone (``size_curve``): what the TTFT-model choice (``regime_on``) starts from."""

    curve: MissRatioCurve
    returning_distance_median_tokens: float | None
    floor_tokens: int
    out_tokens: int | None
    chosen: Regime
    trace: Any = None               # the size's prompts as chunk hashes (``workload_trace``)


def size_curve(size: Any, facts: Any, profile: Any, history: str = "live") -> SizeCurve:
    """The curve of a size's workload in the closed loop's send order at ``size.concurrency`` users
    (``facts.trace`` when the facts carry one) and the capacities the curve alone chooses."""
    from kvtier.demo.live import engine_size
    from kvtier.demo.sizing import ENGINE_BLOCK_TOKENS, max_model_len

    trace = getattr(facts, "trace", None)
    trace = trace if trace is not None else synthetic_trace(facts)
    out = None if history == "live" else size.max_tokens
    order = send_order(facts, size.concurrency, profile, size.think_time_scale, out_tokens=out)
    curve, med, ram_curve = curves_in_order(trace, order)
    floor = max_model_len(engine_size(size, history)) + ENGINE_BLOCK_TOKENS
    chosen = choose_capacities(curve, floor_tokens=floor, working_set_tokens=facts.working_set_tokens,
                               users=size.concurrency, returning_distance_median_tokens=med, ram_curve=ram_curve,
                               ram_order_share=DEFAULT_ORDER_SHARE)
    return SizeCurve(curve, med, floor, out, chosen, trace)


def ram_curve_at(sc: SizeCurve, size: Any, facts: Any, profile: Any, share: float) -> MissRatioCurve:
    """RAM-only's curve: chains evicted tail first, the prompts in the order the closed loop sends them
    when every turn gets ``share`` of its ideal hit and requests queue for the engine's KV space."""
    order = send_order(facts, size.concurrency, profile, size.think_time_scale, share, sc.out_tokens,
                       sc.chosen.engine.tokens)
    return curve_in_order(sc.trace, order, tail_first=True)[0]


def ram_only_at(sc: SizeCurve, size: Any, facts: Any, profile: Any, ram_tokens: int,
                engine_tokens: int | None = None) -> tuple[float, float]:
    """(RAM-only's predicted token hit rate, the share of the ideal its send order was modelled at) for
    a RAM tier of ``ram_tokens`` beside the engine's KV space (``engine_tokens``, default the chosen
    one): the same rounds as ``regime_on``, at fixed capacities."""
    engine = -(-int(engine_tokens if engine_tokens is not None else sc.chosen.engine.tokens) // CHUNK_TOKENS)
    ram = -(-int(ram_tokens) // CHUNK_TOKENS)
    ideal = sc.curve.ideal_hit_rate
    share, hit = sc.chosen.ram.share_of_ideal, 0.0
    for _ in range(RAM_ORDER_ROUNDS):
        key = round(share, 2)
        hit = ram_only_hit_rate(ram_curve_at(sc, size, facts, profile, key), engine, ram)
        share = hit / ideal if ideal > 0 else 0.0
        if abs(share - key) <= RAM_ORDER_TOLERANCE:
            return hit, key
    return hit, round(share, 2)


def regime_on(sc: SizeCurve, size: Any, facts: Any, profile: Any) -> Regime:
    """The capacities on ``sc``'s curve with RAM sized by the closed loop's predicted RAM-only speedup
    (``kvtier.demo.sizing.LoopModel`` with the engine's KV space), each configuration's mean TTFT predicted.

    RAM-only is sized and predicted on its own curve (``ram_curve_at``): chains evicted tail first, in
    the order RAM-only sends its turns, which depends on its hit rate (a hit shortens a turn, so the
    conversation comes back sooner and its reuse distance shrinks). The order is modelled at the share
    of the ideal the previous round predicted, until the prediction stays within ``RAM_ORDER_TOLERANCE``
    of that share (``RAM_ORDER_ROUNDS`` at most). On the recorded 2-vCPU AVX2 run (engine 12 chunks,
    RAM 22) one plain-LRU curve in one order at half the ideal said 31.4%; the run measured 65.0%."""
    from kvtier.demo.sizing import LoopModel

    model = LoopModel(profile, facts, size.concurrency, size.think_time_scale, sc.chosen.engine.tokens,
                      sc.curve.ideal_hit_rate, sc.out_tokens)
    share = sc.chosen.ram.share_of_ideal
    curves: dict[float, MissRatioCurve] = {}
    regime = sc.chosen
    for _ in range(RAM_ORDER_ROUNDS):
        key = round(share, 2)
        if key not in curves:
            curves[key] = ram_curve_at(sc, size, facts, profile, key)
        regime = choose_capacities(sc.curve, floor_tokens=sc.floor_tokens, working_set_tokens=facts.working_set_tokens,
                                   users=size.concurrency,
                                   returning_distance_median_tokens=sc.returning_distance_median_tokens,
                                   model=model, ram_curve=curves[key], ram_order_share=key)
        if abs(regime.ram.share_of_ideal - key) <= RAM_ORDER_TOLERANCE:
            break
        share = regime.ram.share_of_ideal
    return regime


def regime_for(size: Any, facts: Any, profile: Any, history: str = "live", *, ttft_model: bool = True) -> Regime:
    """The regime of a size: its workload's curve in the closed loop's send order at ``size.concurrency``
    users, and the capacities chosen on it (``size_curve``). ``ttft_model``: size RAM by the closed
    loop's predicted RAM-only speedup and predict each configuration's mean TTFT (``regime_on``);
    False: by the curve alone (cheap)."""
    sc = size_curve(size, facts, profile, history)
    return regime_on(sc, size, facts, profile) if ttft_model else sc.chosen


@dataclass(frozen=True)
class Budgets:
    """Capacities in tokens and in bytes of the dtype that runs."""

    working_set_tokens: int
    engine_kv_tokens: int
    ram_tokens: int
    ssd_tokens: int
    kv_bytes_per_token: int

    def bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "working_set_bytes": self.bytes(self.working_set_tokens),
                "engine_kv_bytes": self.bytes(self.engine_kv_tokens), "ram_budget_bytes": self.bytes(self.ram_tokens),
                "ssd_budget_bytes": self.bytes(self.ssd_tokens)}


def budgets(size: Any, facts: Any, wf: Any, regime: Regime | None = None) -> Budgets:
    """Capacities in tokens: the points ``regime`` chose on the miss-ratio curve (``kvtier.demo.regime``);
    without one, the fractions of the working set in ``size`` (``engine_kv_fraction``, ``ram_fraction``)."""
    from kvtier.demo.sizing import engine_kv_tokens

    ws = wf.working_set_tokens
    if regime is not None:
        return Budgets(working_set_tokens=ws, engine_kv_tokens=regime.engine.tokens, ram_tokens=regime.ram.tokens,
                       ssd_tokens=regime.ssd.tokens, kv_bytes_per_token=facts.kv_bytes_per_token)
    ram = max(int(ws * size.ram_fraction), 16 * CHUNK_TOKENS)
    return Budgets(working_set_tokens=ws, engine_kv_tokens=engine_kv_tokens(size, wf), ram_tokens=ram,
                   ssd_tokens=max(4 * ws, 64 * CHUNK_TOKENS), kv_bytes_per_token=facts.kv_bytes_per_token)
