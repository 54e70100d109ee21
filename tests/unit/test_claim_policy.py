"""The claim policy: the prefix of the chunks with the largest expected saving (load at most margin x
compute); nothing declined without evidence; a faster tier or a larger margin never claims fewer;
every chunk accounted for."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations.vllm.claim_policy import (
    AFTER_DECLINED,
    SLOW,
    UNAVAILABLE,
    ChunkLoad,
    ClaimRule,
    PrefillCost,
    decide,
)
from kvtier.read_speed import TierSpeed

C = 256
MB = 11_796_480          # one 256-token chunk of SmolLM2-135M float32 KV
COST = PrefillCost(0.004, 1e-6)
TIERS = ("memory", "disk", "shared")


def chunks(tiers, start=0, end=None):
    end = len(tiers) * C if end is None else end
    return [ChunkLoad(t, MB, max(start, i * C), min(end, (i + 1) * C)) for i, t in enumerate(tiers)
            if (i + 1) * C > start and i * C < end]


def speed(read_s, weight=10.0, unavailable_s=0.0):
    return TierSpeed(0.0, MB / read_s, weight, MB, unavailable_s)


def test_fast_tiers_claim_everything_and_a_slow_one_stops_the_chain():
    d = decide(chunks(["memory", "disk", "shared", "shared", "disk"]),
               {"memory": speed(0.005), "disk": speed(0.05), "shared": speed(10.0)}, COST, ClaimRule())
    assert d.claimed == 2
    assert d.declined == {("shared", SLOW): 1, ("shared", AFTER_DECLINED): 1, ("disk", AFTER_DECLINED): 1}
    assert d.reason == SLOW
    assert d.load_s[:3] == [0.005, 0.055, 10.055]          # cumulative: one round of reads per tier so far
    assert decide(chunks(["memory", "disk"]), {"memory": speed(0.005), "disk": speed(0.05)}, COST,
                  ClaimRule()).declined == {}


def test_no_evidence_claims_like_always():
    cs = chunks(["shared"] * 4)
    assert decide(cs, {}, COST, ClaimRule()).claimed == 4                       # tier never read
    assert decide(cs, {"shared": speed(100.0, weight=1.0)}, COST, ClaimRule()).claimed == 4   # faded
    assert decide(cs, {"shared": speed(100.0)}, None, ClaimRule()).claimed == 4  # prefill cost unknown


def test_unavailable_tier_is_declined_even_without_a_cost():
    d = decide(chunks(["memory", "shared", "shared"]), {"shared": speed(0.001, unavailable_s=3.0)}, None,
               ClaimRule())
    assert d.claimed == 1 and d.declined == {("shared", UNAVAILABLE): 1, ("shared", AFTER_DECLINED): 1}


def test_margin_reads_in_flight_and_the_query_still_to_pay():
    two = chunks(["shared", "shared"])
    compute = COST.extend_s(0, 2 * C)
    sp = {"shared": speed(0.75 * compute)}                 # one round of two reads: 0.75 x compute
    assert decide(two, sp, COST, ClaimRule(default_in_flight=2)).claimed == 2
    assert decide(two, sp, COST, ClaimRule(default_in_flight=1)).claimed == 0     # two rounds: 1.5 x
    assert decide(two, sp, COST, ClaimRule(margin=2.0, default_in_flight=1)).claimed == 2
    assert decide(two, sp, COST, ClaimRule(reads_in_flight={"shared": 4}, default_in_flight=1)).claimed == 2
    assert decide(two, sp, COST, ClaimRule(), {"shared": 0.5 * compute}).claimed == 0    # + the query
    assert decide(two, sp, COST, ClaimRule(), {"disk": 0.5 * compute}).claimed == 2      # another tier's


def test_a_slow_chunk_is_claimed_when_the_chunks_after_it_make_up_for_it():
    # round 1 (chunks 0, 1) is slower than computing chunk 0 alone, faster than computing both
    two = chunks(["shared", "shared"])
    one_chunk = COST.extend_s(0, C)
    d = decide(two, {"shared": speed(1.2 * one_chunk)}, COST, ClaimRule())
    assert d.claimed == 2 and d.load_s[0] > d.compute_s[0] and d.load_s[1] < d.compute_s[1]


def test_a_chunk_late_in_the_prompt_is_worth_more_compute():
    cost = PrefillCost(0.001, 1e-5)
    late = ChunkLoad("shared", MB, 4096, 4096 + C)
    early = ChunkLoad("shared", MB, 0, C)
    sp = {"shared": speed(2 * cost.extend_s(0, C) * 2)}   # 2x slower than computing chunk 0
    assert decide([early], sp, cost, ClaimRule()).claimed == 0
    assert decide([late], sp, cost, ClaimRule()).claimed == 1


chunk_lists = st.lists(st.sampled_from(TIERS), min_size=0, max_size=12)
read_times = st.floats(min_value=1e-4, max_value=20.0)
speeds = st.fixed_dictionaries({t: st.one_of(st.none(), read_times) for t in TIERS})
costs = st.one_of(st.none(), st.builds(PrefillCost, st.floats(1e-5, 0.05), st.floats(0.0, 1e-5)))
margins = st.floats(min_value=0.1, max_value=5.0)
fixeds = st.fixed_dictionaries({"shared": st.floats(0.0, 5.0)})


def _speeds(d):
    return {t: speed(v) for t, v in d.items() if v is not None}


def _reference(cs, sp, cost, rule, fixed):
    """(load, compute) of every prefix, written out independently of ``decide``."""
    out = []
    for m in range(1, len(cs) + 1):
        head = cs[:m]
        tiers = {ch.tier for ch in head if sp[ch.tier] is not None}
        load = sum(fixed.get(t, 0.0) + -(-sum(ch.tier == t for ch in head) // rule.in_flight(t)) * sp[t]
                   for t in tiers)
        out.append((load, sum(cost.extend_s(ch.start, ch.end - ch.start) for ch in head)))
    return out


@settings(max_examples=300, deadline=None)
@given(chunk_lists, speeds, costs, margins, st.integers(0, 3 * C), fixeds)
def test_claims_the_prefix_that_saves_most_and_never_one_slower_than_margin_x_compute(
        tiers, sp, cost, margin, start, fixed):
    cs = chunks(tiers, start=start)
    rule = ClaimRule(margin=margin)
    d = decide(cs, _speeds(sp), cost, rule, fixed)
    assert 0 <= d.claimed <= len(cs)
    assert d.claimed + sum(d.declined.values()) == len(cs)          # every chunk accounted for once
    assert sum(k for (_, r), k in d.declined.items() if r != AFTER_DECLINED) == (d.claimed < len(cs))
    if cost is None:
        assert d.claimed == len(cs)
        return
    ref = _reference(cs, sp, cost, rule, fixed)
    saving = [0.0] + [margin * c - ld for ld, c in ref]
    if d.claimed:
        load, compute = ref[d.claimed - 1]
        assert load <= margin * compute * (1 + 1e-9) + 1e-12
    assert saving[d.claimed] >= max(saving) - 1e-9 * (1 + max(abs(x) for x in saving))


@settings(max_examples=300, deadline=None)
@given(chunk_lists, speeds, costs, margins, st.sampled_from(TIERS), st.floats(0.01, 1.0), fixeds)
def test_a_faster_tier_never_claims_less(tiers, sp, cost, margin, which, factor, fixed):
    cs = chunks(tiers)
    rule = ClaimRule(margin=margin)
    before = decide(cs, _speeds(sp), cost, rule, fixed).claimed
    faster = dict(sp)
    if faster[which] is not None:
        faster[which] *= factor
    assert decide(cs, _speeds(faster), cost, rule, fixed).claimed >= before


@settings(max_examples=200, deadline=None)
@given(chunk_lists, speeds, costs, margins, st.floats(1.0, 10.0))
def test_a_larger_margin_never_claims_less(tiers, sp, cost, margin, more):
    cs = chunks(tiers)
    assert decide(cs, _speeds(sp), cost, ClaimRule(margin=margin * more)).claimed >= \
        decide(cs, _speeds(sp), cost, ClaimRule(margin=margin)).claimed
