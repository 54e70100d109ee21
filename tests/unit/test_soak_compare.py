"""benchmarks/soak/compare.py: a kvtier run's worker RSS minus vanilla's, at the same minute and at
the same number of requests served, on synthetic curves."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "soak"))

from compare import compare  # noqa: E402


def test_same_minute_and_same_requests():
    # vanilla: 1,500 MiB + 10 MiB/min, 2 requests/min; kvtier: vanilla + 200 MiB, 6 requests/min
    vanilla = [(float(m), 1500.0 + 10 * m, 2 * m) for m in range(31)]
    run = [(float(m), 1700.0 + 10 * m, 6 * m) for m in range(31)]
    rows = {r["minute"]: r for r in compare(vanilla, run)["rows"]}
    assert rows[10]["minus_vanilla_same_minute_mib"] == 200
    assert rows[10]["requests_served"] == 60
    # vanilla served 60 requests at minute 30 (RSS 1,800): kvtier at minute 10 (1,800) minus that
    assert rows[10]["vanilla_rss_same_requests_mib"] == 1800 and rows[10]["minus_vanilla_same_requests_mib"] == 0
    assert rows[30]["vanilla_rss_same_requests_mib"] is None     # vanilla never served 180 requests
