"""demo slo's duration estimate and its shrink-to-fit (kvtier.demo.slo_sizing)."""

from __future__ import annotations

import pytest

from kvtier.demo import slo
from kvtier.demo.calibrate import fit_profile
from kvtier.demo.slo_sizing import MIN_FIXED_USERS, estimate_slo_run, fit_slo_size

# The 2026-12-01 run on the 2-vCPU AVX2 machine (benchmarks/results/slo/2026-12-01-avx2/, stopped at 50 minutes):
# its calibration, and the wall time of vanilla's three document lengths (warm-up + search + fixed
# point, from the per-point files' times), the run that showed the demo's old "about 15 minutes" false.
AVX2 = fit_profile([(256, 1.0323), (512, 1.9335), (1024, 4.2003)])
AVX2_START_S = 37.1
VANILLA_MEASURED_S = {282: 536.0, 564: 719.0, 1128: 1345.0}
LENGTHS = (282, 564, 1128)


def test_estimate_matches_each_measured_vanilla_length_and_the_searched_points():
    """WALL_FACTOR was read off this run, so the check is that one factor holds at every length
    (the model's growth with length is right) and that the modelled search visits the measured points."""
    e = estimate_slo_run(slo.DEFAULT, LENGTHS, 2.0, AVX2, AVX2_START_S, 128)
    for n, measured in VANILLA_MEASURED_S.items():
        assert e.per_length_s["vanilla"][n] == pytest.approx(measured, rel=0.05), n
    assert e.visited["vanilla"] == {282: [1, 2], 564: [1], 1128: [1]}     # 2 users over at 282, 1 over after
    assert e.visited["kvtier-ram-ssd"][282][:5] == [1, 2, 4, 8, 6]          # as measured before the cut-off
    assert e.seconds > 3000                                                 # the old defaults: ~an hour here


def test_fit_shrinks_in_the_documented_order_and_never_repeats_or_lengths():
    f = fit_slo_size(slo.DEFAULT, LENGTHS, 2.0, AVX2, AVX2_START_S, 128, target_s=900)
    # never below 3 requests per user (kvtier.client.slo.MIN_STEADY_ROUNDS): the defaults already are 3
    assert f.changed == ("fixed_users 16 -> 8", "warm_questions 2 -> 1") and f.size.min_requests_per_user == 3
    assert not f.fits and f.estimate.seconds > 900                      # said, in yellow, by the demo
    assert (f.size.repeats, f.size.lengths, f.size.fixed_users) == (3, 3, MIN_FIXED_USERS)
    full = estimate_slo_run(slo.DEFAULT, LENGTHS, 2.0, AVX2, AVX2_START_S, 128).seconds
    assert f.estimate.seconds < 0.7 * full


def test_fit_stops_as_soon_as_the_estimate_fits():
    full = estimate_slo_run(slo.DEFAULT, LENGTHS, 2.0, AVX2, AVX2_START_S, 128).seconds
    one = fit_slo_size(slo.DEFAULT, LENGTHS, 2.0, AVX2, AVX2_START_S, 128, target_s=full - 1)
    assert one.changed == ("fixed_users 16 -> 8",) and one.fits
    none = fit_slo_size(slo.DEFAULT, LENGTHS, 2.0, AVX2, AVX2_START_S, 128, target_s=full + 1)
    assert none.changed == () and none.fits and none.size == slo.DEFAULT


def test_a_fast_machine_keeps_the_published_size():
    fast = fit_profile([(256, 0.0125), (512, 0.025), (1024, 0.05)])
    ch = slo.choose_slo(fast, slo.DEFAULT)
    f = fit_slo_size(slo.DEFAULT, ch.doc_tokens, ch.slo_s, fast, 10.0, 128, target_s=900)
    assert f.fits and f.size == slo.DEFAULT and f.to_dict()["fixed_users"] == 16
