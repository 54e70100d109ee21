"""`kvtier demo`'s lighter load point keeps the demo to its target: by default it runs only when its
estimate fits the time the main run left; asked for with --light-users N, it always runs."""

from __future__ import annotations

import dataclasses
import json

from kvtier.demo import companion
from kvtier.demo.common import DemoOptions
from tests.unit.test_demo_live import FACTS, FAST, _fake_start
from tests.unit.workload_fakes import WordTokenizer


def _run(tmp_path, monkeypatch, opts: DemoOptions) -> dict:
    monkeypatch.setattr(companion, "LIGHT_USERS", 1)            # the default point, at a size fake servers serve fast
    base = dataclasses.replace(companion.QUICK, min_bound_s=60.0, think_time_scale=0.0)
    return companion.run(base, tmp_path, FACTS, opts, calibration=FAST, tokenizer=WordTokenizer(),
                         start_server=_fake_start({}))


def test_default_light_point_is_skipped_when_the_main_run_used_the_target(tmp_path, monkeypatch):
    # a 0.1-second target: the main run's estimate leaves nothing, so the default point would only add time
    fig = _run(tmp_path, monkeypatch, DemoOptions(users=2, conversations=3, target_s=0.1))
    assert fig["complete"] is True and fig["light_point_skipped"] is True and "light_point" not in fig
    assert not (tmp_path / "users1").exists()
    assert json.loads((tmp_path / "demo.json").read_text())["light_point_skipped"] is True


def test_default_light_point_runs_when_it_fits(tmp_path, monkeypatch):
    fig = _run(tmp_path, monkeypatch, DemoOptions(users=2, conversations=3, target_s=36_000.0))
    assert fig["light_point_skipped"] is False and fig["light_point"]["users"] == 1
    assert (tmp_path / "users1" / "report.md").is_file()


def test_asked_for_light_point_runs_even_past_the_target(tmp_path, monkeypatch):
    fig = _run(tmp_path, monkeypatch, DemoOptions(users=2, conversations=3, target_s=1.0, light_users=1))
    assert fig["light_point_skipped"] is False and fig["light_point"]["users"] == 1
