"""Where a request's time went, by the server's own histograms: before/after deltas of vLLM's queue,
prefill, decode, TTFT and e2e ``_sum``/``_count``; missing histograms are None, never 0."""

from __future__ import annotations

import pytest

from kvtier.client.server_metrics import PHASE_HISTS, parse_metrics, server_delta
from kvtier.client.summary import phase_means


def hist(name: str, total: float, count: float) -> str:
    return (f"# TYPE {name} histogram\n{name}_bucket{{le=\"1.0\",model_name=\"m\"}} {count}\n"
            f"{name}_bucket{{le=\"+Inf\",model_name=\"m\"}} {count}\n{name}_sum{{model_name=\"m\"}} {total}\n"
            f"{name}_count{{model_name=\"m\"}} {count}\n")


def test_phase_histograms_become_per_request_means_over_the_run():
    before = parse_metrics(hist(PHASE_HISTS["queue"], 10.0, 5) + hist(PHASE_HISTS["prefill"], 2.0, 5))
    after = parse_metrics(hist(PHASE_HISTS["queue"], 40.0, 15) + hist(PHASE_HISTS["prefill"], 7.0, 15)
                          + hist(PHASE_HISTS["decode"], 30.0, 10) + hist(PHASE_HISTS["ttft"], 40.0, 10))
    ph = server_delta(before, after)["phases"]
    assert ph["queue"] == {"count": 10.0, "sum_s": 30.0, "mean_s": pytest.approx(3.0)}
    assert ph["prefill"]["mean_s"] == pytest.approx(0.5) and ph["decode"]["mean_s"] == pytest.approx(3.0)
    assert ph["e2e"] == {"count": None, "sum_s": None, "mean_s": None}          # not exported: not zero
    means = phase_means({"server": {"phases": ph}})
    assert means["queue_mean_s"] == pytest.approx(3.0) and means["ttft_mean_s"] == pytest.approx(4.0)
    assert means["queue_share_of_ttft"] == pytest.approx(0.75)


def test_the_histograms_names_are_vllms():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")          # its files, without importing it
    if spec is None or not spec.origin:
        pytest.skip("vLLM is not installed")
    src = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in PHASE_HISTS.values():
        assert f'"{name}"' in src


def test_no_server_figures_give_none():
    assert phase_means(None) == {"queue_mean_s": None, "prefill_mean_s": None, "decode_mean_s": None,
                                 "ttft_mean_s": None, "queue_share_of_ttft": None}
    assert server_delta(parse_metrics(""), parse_metrics(""))["phases"]["queue"]["mean_s"] is None
