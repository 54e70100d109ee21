"""The decode term of the companion demo's estimate: the calibration times a decode step with 1 and
DECODE_BATCH requests, and a live-history turn decodes its tokens one per step of the requests
decoding together at that moment, sharing the engine with the requests in flight. Without a decode
term the live demo ran 1.25-1.46x its estimate; with every user assumed to be decoding
together (a token cost step(users) / users of the engine) it still ran 1.16-1.47x on both CPU
classes (users think, so fewer requests share each step)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtier.demo import companion
from kvtier.demo.calibrate import (DECODE_BATCH, DECODE_TOKENS, Calibration, CalibrationError, fit_profile,
                                   load_calibration, measure_profile, server_decode_timer)
from kvtier.demo.sizing import (SLACK, TurnFacts, WorkloadFacts, closed_loop_seconds, config_seconds, estimate,
                                 size_companion)
from tests.unit.virtual_time import virtual_time  # noqa: F401


def profile(decode=((1, 0.05), (4, 0.08))):
    return dataclasses.replace(fit_profile([(256, 1.0), (1024, 1.0 + 1e-9)]), decode_points=tuple(decode))


def test_decode_step_is_the_line_through_the_measured_points():
    p = profile()
    assert p.decode_step_s(1) == pytest.approx(0.05) and p.decode_step_s(4) == pytest.approx(0.08)
    assert p.decode_step_s(6) == pytest.approx(0.10)                 # 0.05 + 0.01 per extra request
    assert profile(((1, 0.05),)).decode_step_s(6) == pytest.approx(0.05)
    assert profile(((1, 0.05), (4, 0.04))).decode_step_s(6) == pytest.approx(0.05)   # never below one alone
    assert profile(()).decode_step_s(6) == 0.0                       # older calibrations: no term


def test_calibration_measures_decode_at_one_and_a_batch():
    asked: list[int] = []

    def time_decode(n: int) -> float:
        asked.append(n)
        return 0.05 + 0.01 * (n - 1)

    p = measure_profile(lambda n: 0.1 + n / 1000, (256, 512), budget_s=60, time_decode=time_decode)
    assert asked == [1, DECODE_BATCH] and p.decode_points == ((1, 0.05), (DECODE_BATCH, 0.05 + 0.01 * (DECODE_BATCH - 1)))
    assert measure_profile(lambda n: 0.1 + n / 1000, (256, 512), budget_s=60).decode_points == ()
    with pytest.raises(CalibrationError, match="decode step"):
        measure_profile(lambda n: 0.1 + n / 1000, (256, 512), time_decode=lambda n: 0.0)


def test_decode_points_round_trip_and_older_files_load(tmp_path):
    cal = Calibration(profile=profile(), startup_s=40.0, dtype="float32")
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps(cal.to_dict()))
    back = load_calibration(f, "float32")
    assert back.profile.decode_points == ((1, 0.05), (4, 0.08))
    d = cal.to_dict()
    p = d["profile"]
    assert p["decode_step_1_s"] == pytest.approx(0.05) and p[f"decode_step_{DECODE_BATCH}_s"] == pytest.approx(0.08)
    del d["profile"]["decode_points"]
    f.write_text(json.dumps(d))
    assert load_calibration(f, "float32").profile.decode_points == ()


def one_turn_facts(out_tokens: int) -> WorkloadFacts:
    return WorkloadFacts(requests=1, prompt_tokens=256, ideal_hit_tokens=0, think_s=0.0, max_prompt_tokens=256,
                         conversations=((TurnFacts(256, 0, 0.0, out_tokens),),))


def test_a_live_turn_pays_its_own_decode_and_a_workload_turn_the_fixed_max_tokens():
    p = profile()
    base = config_seconds(p, one_turn_facts(0), users=1, think_time_scale=1.0, hit_share=1.0)
    live = config_seconds(p, one_turn_facts(50), users=1, think_time_scale=1.0, hit_share=1.0)
    assert live - base == pytest.approx(SLACK * 50 * 0.05)
    fixed = config_seconds(p, one_turn_facts(50), users=1, think_time_scale=1.0, hit_share=1.0, out_tokens=4)
    assert fixed - base == pytest.approx(SLACK * 4 * 0.05)
    # six users decoding together: each token costs the 6-request step / 6 of the engine
    six = WorkloadFacts(requests=6, prompt_tokens=6 * 256, ideal_hit_tokens=0, think_s=0.0, max_prompt_tokens=256,
                        conversations=tuple((TurnFacts(256, 0, 0.0, 50),) for _ in range(6)))
    no_decode = dataclasses.replace(six, conversations=tuple((TurnFacts(256, 0, 0.0, 0),) for _ in range(6)))
    extra = (config_seconds(p, six, users=6, think_time_scale=1.0, hit_share=1.0)
             - config_seconds(p, no_decode, users=6, think_time_scale=1.0, hit_share=1.0))
    assert extra == pytest.approx(SLACK * 6 * 50 * p.decode_step_s(6) / 6)


def fake_facts(size) -> WorkloadFacts:
    convs = tuple(tuple(TurnFacts(size.system_tokens + 200 * k, (size.system_tokens + 200 * (k - 1)) if k else 0,
                                  size.think_time_s if k else 0.0, size.assistant_tokens)
                        for k in range(6)) for _ in range(size.conversations))
    turns = [t for c in convs for t in c]
    return WorkloadFacts(requests=len(turns), prompt_tokens=sum(t.prompt_tokens for t in turns),
                         ideal_hit_tokens=sum(t.ideal_hit_tokens for t in turns), think_s=sum(t.think_s for t in turns),
                         max_prompt_tokens=max(t.prompt_tokens for t in turns), conversations=convs)


def test_sizing_with_decode_picks_a_smaller_live_run_for_the_same_target():
    fast, slow = profile(()), profile(((1, 0.06), (4, 0.09)))
    # one interleaving (8 users): the comparison is between the two machines, not across interleavings;
    # the quick demo's 6-minute target (the search's cost grows with the target: 9 vs 4 conversations
    # here, 38 vs 20 at 15 minutes)
    target = companion.QUICK.target_s
    a = size_companion(companion.DEFAULT, fast, 40.0, target, fake_facts, users=8)
    b = size_companion(companion.DEFAULT, slow, 40.0, target, fake_facts, users=8)
    assert b.size.conversations < a.size.conversations
    assert estimate(slow, 40.0, b.size, b.facts, "live", b.regime)[0] == pytest.approx(b.estimate_s)
    w = size_companion(companion.DEFAULT, slow, 40.0, target, fake_facts, history="workload", users=8)
    assert w.size.conversations >= b.size.conversations     # workload history generates max_tokens (8) only


def test_server_decode_timer_times_the_steps_after_the_first_token(virtual_time):
    from tests.unit.fake_openai_server import FakeBehavior

    # virtual time: the step is exactly the fake's token delay (real seconds gain scheduling delays)
    with virtual_time.server(FakeBehavior(first_token_delay_s=0.05, token_delay_s=0.01)) as srv:
        step = server_decode_timer(srv.url)(2)
        bodies = [r.body for r in srv.state.requests]
    assert len(bodies) == 2 and all(b["max_tokens"] == DECODE_TOKENS and b["ignore_eos"] for b in bodies)
    assert len({tuple(b["prompt"]) for b in bodies}) == 2            # fresh prompts, nothing shared
    assert step == pytest.approx(0.01, abs=1e-9)                      # the token delay, not the first token's


def test_a_token_costs_the_step_of_the_requests_decoding_at_that_moment_not_of_all_users():
    step = profile(((1, 0.1), (2, 0.11))).decode_step_s
    # two users, never in flight together: each token takes a 1-request step (0.1 s), not step(2) / 2
    assert closed_loop_seconds([[(1.0, 0.0, 10)], [(1.0, 100.0, 10)]], users=2, decode_step=step) == pytest.approx(
        100.0 + 1.0 + 10 * 0.1)
    # decoding together: one 2-request step (0.11 s) gives each of them a token
    assert closed_loop_seconds([[(0.0, 0.0, 10)], [(0.0, 0.0, 10)]], users=2, decode_step=step) == pytest.approx(1.1)
    # one decoding beside one prefilling: the decoder gets half the engine (a token per 0.2 s) until the
    # other's 1 s prefill (at half speed: 2 s) ends, then it decodes alone
    t = closed_loop_seconds([[(0.0, 0.0, 20)], [(1.0, 0.0, 0)]], users=2, decode_step=step)
    assert t == pytest.approx(2.0 + (20 - 2.0 / 0.2) * 0.1)
    # without a decode step, tokens cost nothing (the prefill-only closed loop)
    assert closed_loop_seconds([[(1.0, 0.0, 10)]], users=1) == pytest.approx(1.0)


def test_the_estimate_charges_a_lone_request_the_one_request_step():
    p = profile(((1, 0.1), (2, 0.11)))
    apart = WorkloadFacts(requests=2, prompt_tokens=512, ideal_hit_tokens=0, think_s=100.0, max_prompt_tokens=256,
                          conversations=((TurnFacts(256, 0, 0.0, 10),), (TurnFacts(256, 0, 100.0, 10),)))
    # the second user's request is sent at 100 s, alone: prefill + 10 one-request steps
    # (the earlier estimate charged step(2) / 2 = 0.055 s a token, as if both users always decoded together)
    assert config_seconds(p, apart, users=2, think_time_scale=1.0, hit_share=1.0) == pytest.approx(
        SLACK * (100.0 + p.seconds(256) + 10 * 0.1))
