"""bench prefetch: the servers it starts (a writer, then per latency a reader without and with queue-time
prefetch over the same shared directory), its option checks, the figures it reads from a replay summary
and the ratios it prints; bad CLI input is one clear line."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from kvtier.bench.prefetch_bench import (WRITER, PrefetchBenchOptions, point_from_summary, prefetch_ratios,
                                         prefetch_specs, reader_name)
from kvtier.commands import prefetch_cmd
from kvtier.config import KvtierConfig


def test_specs_writer_then_readers_over_one_shared_directory(tmp_path):
    opts = PrefetchBenchOptions(model="/m", latencies_ms=(0.0, 40.0), prefetch_bytes=2**20, ram_bytes=2**22)
    specs = prefetch_specs(opts, tmp_path / "shared")
    assert [s.name for s in specs] == [WRITER, "reader-0ms", "reader-0ms-prefetch", "reader-40ms",
                                       "reader-40ms-prefetch"]
    for s in specs:
        cfg = KvtierConfig.model_validate(s.kvtier_config)          # a valid kvtier config
        assert cfg.store.shared is not None and cfg.store.shared.path == tmp_path / "shared"
        assert not cfg.store.disk.enabled and cfg.store.memory.capacity == 2**22
        assert s.model == "/m" and s.kv_cache_space_gib == opts.kv_cache_space_gib
    prefetch = {s.name: s.kvtier_config["connector"]["prefetch_ram"] for s in specs}
    assert prefetch == {WRITER: 0, "reader-0ms": 0, "reader-0ms-prefetch": 2**20, "reader-40ms": 0,
                        "reader-40ms-prefetch": 2**20}
    faults = {s.name: s.kvtier_config["store"].get("faults") for s in specs}
    # the writer and the 0 ms readers see the directory as it is; only the slow readers get the latency
    assert faults[WRITER] is None and faults["reader-0ms"] is None and faults["reader-0ms-prefetch"] is None
    assert faults["reader-40ms"] == faults["reader-40ms-prefetch"] == {"wraps": "shared", "latency_ms": 40.0}


@pytest.mark.parametrize("kw,msg", [
    ({"latencies_ms": ()}, "at least one"),
    ({"latencies_ms": (-1.0,)}, ">= 0"),
    ({"latencies_ms": (5.0, 5.0)}, "distinct"),
    ({"prefetch_bytes": 0}, "> 0"),
    ({"prefetch_bytes": 2**21, "ram_bytes": 2**20}, "fit in the RAM tier"),
])
def test_bad_options_name_the_problem(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PrefetchBenchOptions(model="/m", **kw).check()


def _summary(returning_mean: float, returning_p90: float, ram: float, shared: float, prefetched: dict) -> dict:
    kv = {"kvtier_connector_hit_tokens_total{tier=memory}": ram,
          "kvtier_connector_hit_tokens_total{tier=shared}": shared,
          "kvtier_connector_load_seconds_sum": 2.0, "kvtier_connector_load_seconds_count": 8.0}
    kv.update({f"kvtier_connector_prefetch_chunks_total{{outcome={k}}}": v for k, v in prefetched.items()})
    return {"requests_ok": 10, "ttft_mean_s": 1.5, "token_hit_rate": 0.6,
            "later_turns": {"requests": 7, "ttft_mean_s": returning_mean, "ttft_p90_s": returning_p90},
            "server": {"kvtier": kv, "phases": {"queue": {"mean_s": 0.75}}}}


def test_point_and_ratios_from_summaries():
    off = point_from_summary(reader_name(50, False), 50.0, False, _summary(2.0, 4.0, 0, 900, {}))
    on = point_from_summary(reader_name(50, True), 50.0, True,
                            _summary(1.0, 1.6, 850, 50, {"copied": 12, "cancelled": 1}))
    assert (off.returning_requests, off.returning_ttft_mean_s, off.hit_tokens_shared) == (7, 2.0, 900.0)
    assert off.load_seconds_mean == pytest.approx(0.25) and off.queue_seconds_mean == 0.75
    assert on.prefetch_chunks == {"copied": 12.0, "cancelled": 1.0} and on.hit_tokens_ram == 850.0
    assert prefetch_ratios([off, on]) == {"50ms": {"returning_ttft_mean": pytest.approx(2.0),
                                                   "returning_ttft_p90": pytest.approx(2.5)}}
    # a latency measured without its prefetching reader has no ratio; a missing figure is None, not 0
    lone = point_from_summary(reader_name(0, False), 0.0, False, {"requests_ok": 0})
    assert prefetch_ratios([lone]) == {}
    assert lone.returning_ttft_mean_s is None and lone.load_seconds_mean is None


@pytest.mark.parametrize("args,msg", [
    (["--latency-ms", "0,fast"], "--latency-ms"),
    (["--latency-ms", "10,10"], "distinct"),
    (["--memory-capacity", "1MiB", "--prefetch-ram", "2MiB"], "fit in the RAM tier"),
    (["--memory-capacity", "lots"], "--memory-capacity"),
])
def test_cli_bad_input_is_one_clear_error(tmp_path, args, msg):
    wl = tmp_path / "w.jsonl"
    wl.write_text("")
    app = typer.Typer()
    prefetch_cmd.register(app)
    app.command("unused")(lambda: None)                      # two commands: invoked by name, as under `bench`
    r = CliRunner().invoke(app, ["prefetch", str(wl), "--model", "/m", "--out", str(tmp_path / "o"), *args],
                           env={"COLUMNS": "250"})
    assert r.exit_code != 0
    assert msg in r.output and "Traceback" not in r.output


def test_a_server_error_names_its_cause_on_one_line():
    err = ("server 'writer' exited with code 1 during startup; last log lines (/o/writer/server.log):\n"
           "INFO starting\n  ValueError: To serve at least one request with the model's max seq len (2048) ...\n\n")
    line = prefetch_cmd.error_line(err)
    assert "\n" not in line and line.startswith("server 'writer' exited") and line.endswith("max seq len (2048) ...")
    assert prefetch_cmd.error_line("refused") == "refused" and prefetch_cmd.error_line("") == "failed"
