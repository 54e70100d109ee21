"""compare: config parsing, per-config fresh servers (fake launcher), speedups and the report.

The run itself is in virtual time (tests/unit/virtual_time.py): the fake servers answer in-process
and the clock moves only as their delays say, so speedups and the SLO knee are exact on a loaded
machine. The launcher's own process handling is tested on real processes in test_bench_server.py."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.bench.compare import load_compare_specs, run_compare
from kvtier.client.replay import ReplayOptions
from kvtier.client.slo import SloOptions
from kvtier.config import ConfigError
from kvtier.server import ServerError, ServerSpec
from tests.unit.fake_openai_server import FakeBehavior
from tests.unit.test_bench_replay import make_workload
from tests.unit.virtual_time import virtual_time  # noqa: F401


def test_load_compare_specs_with_defaults_and_kvtier(tmp_path):
    (tmp_path / "kv.yaml").write_text("store: {chunk_size: 128}\n")
    p = tmp_path / "c.yaml"
    p.write_text("""
defaults: {kv_cache_space_gib: 1.5, max_model_len: 2048, model: /m}
configs:
  - name: base
    enable_prefix_caching: false
  - name: kv
    kvtier_config_file: kv.yaml
    kvtier: {store: {disk: {enabled: true}}}
    extra_args: [--max-num-seqs, "4"]
""")
    base, kv = load_compare_specs(p)
    assert base == ServerSpec(name="base", model="/m", max_model_len=2048, kv_cache_space_gib=1.5,
                              enable_prefix_caching=False)
    assert kv.kvtier_config == {"store": {"chunk_size": 128, "disk": {"enabled": True}}}
    assert kv.extra_args == ("--max-num-seqs", "4")


@pytest.mark.parametrize("text,msg", [
    ("- {name: a}\n- {name: a}\n", "unique"),
    ("- {name: a, bogus: 1}\n", "bogus"),
    ("- {name: a, kvtier: {store: {chunk_size: 0}}}\n", "kvtier.store.chunk_size"),
    ("[]\n", "non-empty list"),
    ("configs: [{name: a}]\nextra: 1\n", "unknown top-level"),
    ("- {name: a, dtype: bf32}\n", "dtype"),
])
def test_bad_compare_configs_are_clear(tmp_path, text, msg):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_compare_specs(p, model="/m")


def test_compare_dtype_entries_and_command_default(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("- {name: a}\n- {name: b, dtype: bfloat16}\n- {name: c, dtype: auto}\n")
    a, b, c = load_compare_specs(p, model="/m")
    assert (a.dtype, b.dtype, c.dtype) == ("auto", "bfloat16", "auto")
    a, b, c = load_compare_specs(p, model="/m", dtype="float32")   # --dtype applies where an entry is silent
    assert (a.dtype, b.dtype, c.dtype) == ("float32", "bfloat16", "auto")


def fake_launcher(vt, delays: dict[str, float], seen: list):
    """A fake server as the 'vLLM' of each spec (first-token delay by config name), logging to
    ``log_path`` as VllmServer does; an unknown name fails to start like a crashing server."""
    @contextmanager
    def start(spec: ServerSpec, log_path, ready_timeout_s: float):
        seen.append(spec)
        if spec.name not in delays:
            raise ServerError(f"server {spec.name!r} exited with code 1 during startup; last log lines:\nboom")
        if spec.kvtier_config:
            disk = Path(spec.kvtier_config["store"]["disk"]["path"])
            assert disk.is_dir() and not any(disk.iterdir()), "disk tier dir must be fresh and empty"
        Path(log_path).write_text(f"fake server {spec.name}, first-token delay {delays[spec.name]} s\n")
        with vt.server(FakeBehavior(first_token_delay_s=delays[spec.name])) as srv:
            yield SimpleNamespace(base_url=srv.url)
    return start


def test_run_compare_writes_report_with_speedups(tmp_path, virtual_time):
    wl = make_workload(tmp_path / "w.jsonl", n_conv=6, n_turns=3)
    specs = [ServerSpec(name="baseline", model="/m"),
             ServerSpec(name="broken", model="/m"),
             ServerSpec(name="kvtier-disk", model="/m", kvtier_config={"store": {"disk": {"enabled": True}}})]
    seen: list[ServerSpec] = []
    out = tmp_path / "cmp"
    res = run_compare(wl, specs, out, ReplayOptions(concurrency=3, progress=False),
                      slo=SloOptions(slo_s=0.5, max_load=4, requests_per_point=8),
                      start_server=fake_launcher(virtual_time, {"baseline": 0.2, "kvtier-disk": 0.05}, seen),
                      ready_timeout_s=30)
    assert [r.name for r in res.runs] == ["baseline", "broken", "kvtier-disk"]
    base, broken, kv = res.runs
    assert base.summary["requests_ok"] == 18 and kv.summary["requests_ok"] == 18
    assert broken.error and "boom" in broken.error and broken.summary is None
    assert res.speedups["kvtier-disk"]["ttft_mean"] == pytest.approx(4.0)  # 0.2 s vs 0.05 s first-token delay
    assert res.speedups["baseline"]["ttft_mean"] == pytest.approx(1.0)
    # the fresh disk dir was created for the run and removed afterwards
    disk = Path(seen[-1].kvtier_config["store"]["disk"]["path"])
    assert disk.parent == out / "kvtier-disk" and not disk.exists()
    data = json.loads((out / "compare.json").read_text())
    assert data["baseline"] == "baseline" and data["configs"][1]["error"]
    assert data["configs"][2]["slo"]["best_load"] == 4
    for f in ("report.md", "ttft_cdf.png", "ttft_vs_prompt.png", "hit_rate_over_time.png", "slo_curve.png",
              "baseline/requests.jsonl", "baseline/summary.json", "baseline/server.log",
              "kvtier-disk/slo/slo.json"):
        assert (out / f).exists(), f
        assert (out / f).stat().st_size > 0, f
    report = (out / "report.md").read_text()
    assert "| kvtier-disk |" in report and "failed:" in report and "![ttft_cdf](ttft_cdf.png)" in report
    assert (out / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvtier_configs_get_their_own_metrics_port_by_default() -> None:
    from kvtier.bench.compare import _extra_metrics, _with_metrics_port

    plain = ServerSpec(name="vllm", model="/m")
    assert _with_metrics_port(plain) is plain and _extra_metrics(plain) == ()
    kv = _with_metrics_port(ServerSpec(name="kv", model="/m", kvtier_config={"store": {"chunk_size": 256}}))
    port = kv.kvtier_config["metrics"]["port"]
    assert kv.kvtier_config["store"] == {"chunk_size": 256}
    assert _extra_metrics(kv) == (f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{port + 1}/metrics")
    fixed = ServerSpec(name="kv", model="/m", kvtier_config={"metrics": {"port": 9400}})
    assert _with_metrics_port(fixed) is fixed


def test_a_typo_in_any_configuration_fails_before_the_first_server_starts(tmp_path) -> None:
    started = []

    def start(spec, log_path, ready_timeout_s=0):
        started.append(spec.name)
        raise AssertionError("must not start")

    specs = [ServerSpec(name="ok", model="/m"),
             ServerSpec(name="typo", model="/m", kvtier_config={"store": {"chunk_sise": 256}})]
    wl = tmp_path / "w.jsonl"
    with pytest.raises(ConfigError, match=r"server 'typo': kvtier\.store\.chunk_sise"):
        run_compare(wl, specs, tmp_path / "out", ReplayOptions(), start_server=start)
    assert started == []
