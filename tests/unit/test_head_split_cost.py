"""The KV-head split cost benchmark's core on a tiny size: bytes round trip, entries per side."""

import importlib.util
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("head_split_cost",
                                              ROOT / "benchmarks" / "kv_heads" / "head_split_cost.py")
bench = sys.modules.setdefault("head_split_cost", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench)


def test_disk_round_trip_and_entries(tmp_path):
    with ExitStack() as stack:
        site = bench.open_site("disk", stack, tmp_path, settle=False)
        res = bench.measure(site, bench.Sizes(16, 2), rounds=1, warmup=False, log=lambda _: None)
    rows = res["rounds"]
    assert [r["bytes_equal"] and r["ok"] for side in bench.SIDES for r in rows[side]] == [True, True]
    assert (rows["per rank"][0]["entries"], rows["per KV head"][0]["entries"]) == (2, 16)
