"""``kvtier demo --repeats N``: the configurations run N times, the order reversed every other repeat;
each speedup is taken against vanilla of the same repeat and summarised as median (min-max)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from kvtier.demo import companion
from kvtier.demo.common import DemoOptions
from kvtier.demo.repeats import repeat_entry, repeat_order, summarize
from tests.unit.test_demo_live import FACTS, FAST, _fake_start
from tests.unit.workload_fakes import WordTokenizer

NAMES = ["vanilla", "kvtier-ram", "kvtier-ram-ssd"]


def _run(name: str, ttft: float, returning: float | None = None, ok: int = 10, hit: float = 0.5):
    summary = {"ttft_mean_s": ttft, "requests_ok": ok, "token_hit_rate": hit,
               "later_turns": {"ttft_mean_s": returning if returning is not None else ttft}}
    return SimpleNamespace(name=name, summary=summary, error=None)


def test_the_order_is_reversed_every_other_repeat():
    assert [repeat_order(NAMES, k) for k in (1, 2, 3)] == [NAMES, NAMES[::-1], NAMES]
    with pytest.raises(ValueError):
        repeat_order(NAMES, 0)


def test_a_linear_drift_falls_alike_on_every_configuration():
    # three identical configurations on a machine 10% slower at every replay: a fixed order gives RAM+SSD
    # 0.83x in every repeat; alternating the order brings the median back to ~1x
    def entries(alternate: bool):
        out, t = [], 1.0
        for k in (1, 2):
            order = repeat_order(NAMES, k) if alternate else NAMES
            runs = []
            for name in order:
                runs.append(_run(name, t))
                t *= 1.1
            out.append(repeat_entry(k, runs, planned=10))
        return summarize(out)

    fixed, alternating = entries(False), entries(True)
    assert fixed["configs"]["kvtier-ram-ssd"]["speedup"]["median"] == pytest.approx(1 / 1.21)
    assert alternating["configs"]["kvtier-ram-ssd"]["speedup"]["median"] == pytest.approx(1.0, abs=0.03)
    assert alternating["configs"]["kvtier-ram"]["speedup"]["median"] == pytest.approx(1.0, abs=0.01)


def test_speedups_are_against_vanilla_of_the_same_repeat():
    e1 = repeat_entry(1, [_run("vanilla", 4.0, 5.0), _run("kvtier-ram", 2.0, 2.0)], planned=10)
    e2 = repeat_entry(2, [_run("kvtier-ram", 4.0, 4.0), _run("vanilla", 6.0, 8.0)], planned=10)
    e3 = repeat_entry(3, [_run("vanilla", 3.0, 3.0), _run("kvtier-ram", 3.0, 3.0, ok=9)], planned=10)
    s = summarize([e1, e2, e3])
    ram = s["configs"]["kvtier-ram"]
    assert ram["speedup"]["per_repeat"] == [2.0, 1.5, 1.0] and ram["speedup"]["median"] == 1.5
    assert ram["speedup_returning_turns"]["per_repeat"] == [2.5, 2.0, 1.0]
    assert (ram["ttft_mean_s"]["min"], ram["ttft_mean_s"]["max"]) == (2.0, 4.0)
    assert s["configs"]["vanilla"]["speedup"]["median"] == 1.0
    # the third repeat served 9 of 10 requests: said, not hidden
    assert [e["complete"] for e in s["runs"]] == [True, True, False] and s["complete"] is False
    assert s["orders"] == [["vanilla", "kvtier-ram"], ["kvtier-ram", "vanilla"], ["vanilla", "kvtier-ram"]]


def test_demo_runs_the_repeats_in_alternating_order_and_reports_them(tmp_path):
    base = dataclasses.replace(companion.QUICK, min_bound_s=60.0, think_time_scale=0.0)
    fig = companion.run(base, tmp_path, FACTS, DemoOptions(users=2, conversations=3, light_users=0, repeats=2),
                        calibration=FAST, tokenizer=WordTokenizer(), start_server=_fake_start({}))
    rep = fig["repeats"]
    assert rep["repeats"] == 2 and rep["complete"] is True
    assert rep["orders"] == [NAMES, NAMES[::-1]]
    assert all(len(c["ttft_mean_s"]["per_repeat"]) == 2 for c in rep["configs"].values())
    assert rep["configs"]["vanilla"]["speedup"]["per_repeat"] == [1.0, 1.0]
    # repeat 1 is the demo's own run; repeat 2 has its own folder and report
    assert rep["runs"][0]["configs"]["vanilla"]["ttft_mean_s"] == fig["compared"]["vanilla"]["ttft_mean_s"]
    assert (tmp_path / "repeat-2" / "report.md").is_file()
    assert all((tmp_path / "repeat-2" / n / "requests.jsonl").is_file() for n in NAMES)
    report = (tmp_path / "report.md").read_text()
    assert "## 2 repeats in alternating order" in report and "repeat-2/report.md" in report
    assert json.loads((tmp_path / "demo.json").read_text())["repeats"]["repeats"] == 2


def test_one_run_has_no_repeats_section(tmp_path):
    base = dataclasses.replace(companion.QUICK, min_bound_s=60.0, think_time_scale=0.0)
    fig = companion.run(base, tmp_path, FACTS, DemoOptions(users=2, conversations=3, light_users=0),
                        calibration=FAST, tokenizer=WordTokenizer(), start_server=_fake_start({}))
    assert "repeats" not in fig and not (tmp_path / "repeat-2").exists()
    assert "repeats in alternating order" not in (tmp_path / "report.md").read_text()
