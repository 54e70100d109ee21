"""Live read-speed and prefill estimates: decayed by count and by age, latency told apart from
bandwidth when read sizes differ, failures mark a tier unavailable for a while, thread-safe."""

from __future__ import annotations

import threading

import pytest

from kvtier.read_speed import UnitSpeed, ReadSpeeds, TierSpeed, fold


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_one_size_reads_give_the_mean_read_time_with_the_latency_prior():
    clock = Clock()
    rs = ReadSpeeds(prior_latency_s=0.01, clock=clock)
    for _ in range(5):
        rs.record("disk", 1_000_000, 0.11)
    sp = rs.get("disk")
    assert sp is not None and sp.latency_s == pytest.approx(0.01)
    assert sp.bytes_per_s == pytest.approx(1e7)
    assert sp.read_s(1_000_000) == pytest.approx(0.11)
    assert sp.weight == pytest.approx(5)                  # the samples, decayed by age only


def test_reads_of_two_sizes_separate_latency_and_bandwidth():
    rs = ReadSpeeds(clock=Clock())
    for _ in range(4):
        rs.record("shared", 1_000_000, 0.5 + 1_000_000 / 2e8)
        rs.record("shared", 4_000_000, 0.5 + 4_000_000 / 2e8)
    sp = rs.get("shared")
    assert sp.latency_s == pytest.approx(0.5, rel=1e-6)
    assert sp.bytes_per_s == pytest.approx(2e8, rel=1e-6)


def test_estimate_follows_recent_reads_and_fades_with_age():
    clock = Clock()
    rs = ReadSpeeds(alpha=0.5, half_life_s=10.0, clock=clock)
    for _ in range(10):
        rs.record("disk", 1000, 1.0)
    for _ in range(10):
        rs.record("disk", 1000, 0.1)
    assert rs.get("disk").read_s(1000) == pytest.approx(0.1, rel=0.01)   # old samples forgotten
    w = rs.get("disk").weight
    clock.t = 20.0
    assert rs.get("disk").weight == pytest.approx(w / 4)                # two half-lives
    assert not rs.get("disk").trusted(w / 2)


def test_failure_marks_a_tier_unavailable_until_it_expires_or_a_read_succeeds():
    clock = Clock()
    rs = ReadSpeeds(unavailable_s=5.0, clock=clock)
    rs.failed("shared")
    assert rs.get("shared").unavailable_s == pytest.approx(5.0)
    clock.t = 3.0
    assert rs.get("shared").unavailable_s == pytest.approx(2.0)
    clock.t = 6.0
    assert rs.get("shared") is None and "shared" not in rs.snapshot()
    rs.failed("shared")
    rs.record("shared", 100, 0.01)
    assert rs.get("shared").unavailable_s == 0.0


def test_version_changes_with_every_sample_and_bad_samples_are_ignored():
    rs = ReadSpeeds(clock=Clock())
    v = rs.version
    rs.record("disk", 0, 1.0)
    rs.record("disk", 10, -1.0)
    assert rs.version == v and rs.snapshot() == {}
    rs.record("disk", 10, 0.1)
    assert rs.version == v + 1 and set(rs.snapshot()) == {"disk"}
    with pytest.raises(ValueError):
        ReadSpeeds(alpha=0)


def test_concurrent_records_lose_nothing():
    rs = ReadSpeeds(alpha=1e-9, half_life_s=1e9)

    def work():
        for _ in range(500):
            rs.record("disk", 1000, 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rs.version == 2000
    assert rs.get("disk").weight == pytest.approx(2000, rel=1e-3)


def test_fold_keeps_the_slower_rank_and_any_failure():
    fast, slow = TierSpeed(0.0, 1e9, 5.0, 1e6), TierSpeed(0.1, 1e8, 3.0, 1e6, unavailable_s=2.0)
    f = fold(fast, slow)
    assert f.read_s() == slow.read_s() and f.weight == 3.0 and f.unavailable_s == 2.0
    assert fold(slow, fast) == f


def test_prefill_speed_is_seconds_per_unit_once_enough_passes():
    clock = Clock()
    ps = UnitSpeed(half_life_s=100.0, clock=clock)
    assert ps.seconds_per_unit(2) is None
    ps.record(1000, 4.0)
    assert ps.seconds_per_unit(2) is None
    ps.record(2000, 8.0)
    assert ps.seconds_per_unit(2) == pytest.approx(0.004)
    ps.record(0, 1.0)                       # nothing computed: ignored
    assert ps.seconds_per_unit(2) == pytest.approx(0.004)
    clock.t = 1000.0                        # faded: unknown again
    assert ps.seconds_per_unit(2) is None
