"""The soak's verdict (benchmarks/soak/verdict.py) on synthetic samples: each budget or growth
breach fails the run with a reason; a steady run passes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "soak"))

from verdict import MIB, summarize  # noqa: E402

OK = {"requests_ok": 100, "requests_failed": 0, "requests_cancelled": 0}


def _samples(n=10, rss=lambda i: 1000 * MIB, fds=lambda i: 50, threads=lambda i: 30, disk=lambda i: 10 * MIB):
    return [{"t": 60.0 * i, "disk_bytes": disk(i),
             "procs": {"1": {"name": "vllm", "rss": rss(i), "fds": fds(i), "threads": threads(i)}}}
            for i in range(n)]


def test_steady_run_passes():
    s = summarize(OK, _samples(), ssd_budget=100 * MIB, ram_budget=200 * MIB)
    assert s["passed"] and not s["why_not"]
    assert s["processes"]["1"]["rss_budget"] == 1000 * MIB + 200 * MIB + 256 * MIB


def test_each_breach_fails_with_a_reason():
    cases = {
        "RSS": _samples(rss=lambda i: 1000 * MIB + i * 100 * MIB),
        "grew": _samples(fds=lambda i: 50 + 5 * i),
        "threads": None,
        "SSD": _samples(disk=lambda i: 150 * MIB if i == 4 else 10 * MIB),
    }
    cases["threads"] = _samples(threads=lambda i: 30 + (20 if i > 6 else 0))
    for word, samples in cases.items():
        s = summarize(OK, samples, ssd_budget=100 * MIB, ram_budget=200 * MIB)
        assert not s["passed"], word
        assert any(("grew" if word == "threads" else word) in w for w in s["why_not"]), (word, s["why_not"])


def test_failed_or_cancelled_requests_fail():
    for replay in ({**OK, "requests_failed": 1}, {**OK, "requests_cancelled": 2}, {**OK, "requests_ok": 0}):
        s = summarize(replay, _samples(), ssd_budget=100 * MIB, ram_budget=200 * MIB)
        assert not s["passed"] and "requests" in s["why_not"][0]


def test_threads_started_on_the_first_requests_are_not_growth():
    # thread pools start with the first requests (sample 1): the baseline is the warmed-up sample 2
    s = summarize(OK, _samples(threads=lambda i: 10 if i < 1 else 30), ssd_budget=100 * MIB, ram_budget=200 * MIB)
    assert s["passed"], s["why_not"]
