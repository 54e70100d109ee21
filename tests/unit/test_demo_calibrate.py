"""Calibration and sizing on a fake timing function: the fit, the budget, and a size that keeps
the experiment's ratios while aiming at the target wall time."""

from __future__ import annotations

import json

import pytest

from kvtier.demo import companion
from kvtier.demo.calibrate import (REFERENCE_PREFILL_1K_S, Calibration, CalibrationError, fit_profile, load_calibration,
                                   measure_profile)
from kvtier.demo.sizing import (OVER_TARGET, WorkloadFacts, engine_kv_tokens, estimate, max_model_len, scaled,
                                 size_companion)


def linear_machine(per_1k_s: float, fixed_s: float = 0.05):
    calls: list[int] = []

    def time_prefill(n: int) -> float:
        calls.append(n)
        return fixed_s + per_1k_s * n / 1024
    return time_prefill, calls


def test_fit_recovers_a_linear_machine():
    fn, calls = linear_machine(4.5)
    p = measure_profile(fn, (256, 512, 1024), budget_s=60)
    assert calls[0] <= 64 and calls[1:] == [256, 512, 1024]      # warm-up first, not recorded
    assert [n for n, _ in p.points] == [256, 512, 1024]
    assert p.seconds(1024) == pytest.approx(4.55, rel=1e-3)
    assert p.seconds(2048) == pytest.approx(0.05 + 9.0, rel=1e-3)
    assert p.speed_factor() == pytest.approx(4.55 / REFERENCE_PREFILL_1K_S, rel=1e-3)
    assert p.tokens_for(p.seconds(700)) == pytest.approx(700, abs=1)


def test_fit_keeps_a_quadratic_term():
    p = fit_profile([(256, 0.5 + 256 * 1e-3 + 256 ** 2 * 1e-6), (512, 0.5 + 512e-3 + 512 ** 2 * 1e-6),
                     (1024, 0.5 + 1024e-3 + 1024 ** 2 * 1e-6)])
    assert (p.a, p.b, p.c) == pytest.approx((0.5, 1e-3, 1e-6), rel=1e-6)
    assert p.extend_seconds(1000, 100) == pytest.approx(100e-3 + (1100 ** 2 - 1000 ** 2) * 1e-6)


def test_budget_skips_lengths_that_would_overrun_it():
    spent: list[float] = []

    def slow(n: int) -> float:                # 1K tokens = 40 s: the third length would blow 60 s
        spent.append(0.05 + 40.0 * n / 1024)
        return spent[-1]
    p = measure_profile(slow, (256, 512, 1024), budget_s=60, clock=lambda: sum(spent))
    assert [n for n, _ in p.points] == [256, 512] and p.elapsed_s == pytest.approx(sum(spent))


@pytest.mark.parametrize("points,msg", [([(256, 1.0)], "two or more"), ([(256, 1.0), (512, 0.0)], "non-positive"),
                                        ([(256, 2.0), (1024, 1.0)], "does not grow")])
def test_nonsense_timings_are_one_clear_error(points, msg):
    with pytest.raises(CalibrationError, match=msg):
        fit_profile(points)


def test_calibration_round_trips_and_checks_the_dtype(tmp_path):
    cal = Calibration(profile=fit_profile([(256, 1.0), (1024, 4.0)]), startup_s=40.0, dtype="float32")
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps({"calibration": cal.to_dict()}))
    back = load_calibration(p, "float32")
    assert back.profile.seconds(512) == pytest.approx(cal.profile.seconds(512)) and back.startup_s == 40.0
    with pytest.raises(CalibrationError, match="dtype float32"):
        load_calibration(p, "bfloat16")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match="cannot read"):
        load_calibration(tmp_path / "bad.json", None)


def fake_facts(size) -> WorkloadFacts:
    """A workload model: requests and prompt tokens grow with conversations and token lengths."""
    requests = round(size.conversations * size.turns_mean)
    mean_prompt = size.system_tokens + 4 * (size.user_tokens + size.assistant_tokens)
    total = requests * mean_prompt
    ideal = int(total * 0.8)
    return WorkloadFacts(requests=requests, prompt_tokens=total, ideal_hit_tokens=ideal,
                         think_s=requests * size.think_time_s, max_prompt_tokens=size.max_prompt_tokens)


@pytest.mark.parametrize("per_1k_s", [0.8, 1.6, 4.5, 12.0])
@pytest.mark.parametrize("base", [companion.DEFAULT, companion.QUICK])
def test_size_aims_at_the_target_and_keeps_the_ratios(base, per_1k_s):
    fn, _ = linear_machine(per_1k_s)
    prof = measure_profile(fn, (256, 512, 1024))
    sz = size_companion(base, prof, startup_s=40.0, target_s=base.target_s, facts_of=fake_facts)
    s = sz.size
    # users vs conversations, engine KV and RAM as fractions of the working set: as in the base
    assert s.concurrency == max(1, round(s.conversations * base.concurrency / base.conversations))
    assert (s.engine_kv_fraction, s.ram_fraction) == (base.engine_kv_fraction, base.ram_fraction)
    ekv = engine_kv_tokens(s, sz.facts)
    assert ekv % 128 == 0 and ekv - 128 < int(sz.facts.working_set_tokens * base.engine_kv_fraction) <= ekv
    # think time vs service time: think times follow the machine's remaining slowness
    assert s.think_time_scale == pytest.approx(base.think_time_scale * prof.speed_factor() * sz.length_scale)
    assert sz.estimate_s == pytest.approx(estimate(prof, 40.0, s, sz.facts)[0])
    if not sz.over_target:
        assert sz.estimate_s <= OVER_TARGET * base.target_s
        bigger = scaled(base, sz.length_scale, sz.think_scale, s.conversations + 1)   # the next size is over
        assert estimate(prof, 40.0, bigger, fake_facts(bigger))[0] > base.target_s
    slower = size_companion(base, measure_profile(linear_machine(per_1k_s * 2)[0], (256, 512, 1024)), 40.0,
                            base.target_s, fake_facts)
    assert slower.facts.prompt_tokens <= sz.facts.prompt_tokens


def test_overrides_win_and_are_reported():
    prof = measure_profile(linear_machine(4.5)[0], (256, 512, 1024))
    sz = size_companion(companion.DEFAULT, prof, 40.0, 900, fake_facts, users=3, conversations=5)
    assert (sz.size.concurrency, sz.size.conversations) == (3, 5) and sz.overridden == ("users", "conversations")


def test_a_very_slow_machine_is_over_target_but_keeps_one_full_request_in_the_engine():
    prof = measure_profile(linear_machine(400.0)[0], (256, 512, 1024), budget_s=1e9)
    sz = size_companion(companion.QUICK, prof, 40.0, 360, fake_facts)
    assert sz.over_target
    assert int(sz.facts.working_set_tokens * sz.size.engine_kv_fraction) >= max_model_len(sz.size) + 128


def test_server_timer_sends_fresh_token_prompts_and_fails_clearly():
    from kvtier.demo.calibrate import random_prompt, server_prefill_timer
    from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer

    assert random_prompt(50, seed=1) != random_prompt(50, seed=2) and len(random_prompt(50, seed=1)) == 50
    with FakeOpenAIServer.start(FakeBehavior(first_token_delay_s=0.05)) as srv:
        timer = server_prefill_timer(srv.url)
        assert timer(300) >= 0.05 and timer(600) >= 0.05
        bodies = [r.body for r in srv.state.requests]
        assert [len(b["prompt"]) for b in bodies] == [300, 600] and all(b["max_tokens"] == 1 for b in bodies)
        assert srv.state.cached_tokens == 0          # nothing shared between calibration prompts
    with pytest.raises(CalibrationError, match="failed"):
        server_prefill_timer(srv.url, request_timeout_s=2)(100)   # the server is gone
