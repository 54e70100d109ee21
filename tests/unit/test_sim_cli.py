"""`kvtier simulate | plan | calibrate` on the command line: outputs, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from kvtier.commands import sim_cmd
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, write_workload
from tests.unit.virtual_time import virtual_time  # noqa: F401

app = typer.Typer()


@app.callback()
def _group() -> None:
    """A command group (so the first argument names the command)."""


sim_cmd.register(app)
runner = CliRunner()


def make_wl(tmp_path, n=4):
    convs = [Conversation(id=f"c{i}", turns=[Turn(user=f"hello {i} " * 40, max_tokens=4),
                                             Turn(user="and more " * 30, max_tokens=4, think_time_s=1.0)])
             for i in range(n)]
    p = tmp_path / "w.jsonl"
    write_workload(p, WorkloadHeader(name="t"), convs)
    return p


def test_simulate_prints_and_writes_json_and_plots(tmp_path) -> None:
    wl = make_wl(tmp_path)
    r = runner.invoke(app, ["simulate", str(wl), "--memory-capacity", "1GiB", "--json", str(tmp_path / "s.json"),
                            "--out", str(tmp_path / "out"), "-c", "2"])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["requests_ok"] == 8 and s["ttft_mean_s"] > 0 and 0 < s["token_hit_rate"] < 1
    assert set(s["tier_hit_rate"]) == {"gpu", "ram", "ssd", "shared"}
    assert (tmp_path / "out" / "ttft_cdf.png").is_file() and (tmp_path / "out" / "summary.json").is_file()
    assert (tmp_path / "out" / "tier_hit_rate.png").is_file()
    r = runner.invoke(app, ["simulate", str(wl), "--json", "-"])
    assert r.exit_code == 0 and json.loads(r.output)["requests_ok"] == 8


def test_simulate_reads_raw_mooncake_traces(tmp_path) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 1500, "output_length": 3,
                                     "hash_ids": [0, 1, i + 2]}) + "\n" for i in range(6)))
    r = runner.invoke(app, ["simulate", str(p), "--mode", "trace", "--json", "-"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["requests_ok"] == 6 and s["unit_tokens"] == 512
    assert s["token_hit_rate"] == pytest.approx(5 * 1024 / (6 * 1500))       # hash ids 0, 1 shared


BAD = [
    (["simulate", "MISSING"], "not found"),
    (["simulate", "BADJSON"], "not valid JSON"),
    (["simulate", "WL", "--mode", "sideways"], "--mode"),
    (["simulate", "WL", "--mode", "open"], "rate"),
    (["simulate", "WL", "--memory-capacity", "lots"], "--memory-capacity"),
    (["simulate", "WL", "--eviction", "fifo"], "--eviction"),
    (["simulate", "WL", "--profile", "BADPROFILE"], "engine.block_size"),
    (["simulate", "WL", "--profile", "BADYAML"], "YAML"),
    (["simulate", "WL", "--profile", "no-such-preset"], "unknown profile"),
    (["simulate", "WL", "--max-concurrency", "0"], "concurrency"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle) -> None:
    wl = make_wl(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "turns": [ \n')
    (tmp_path / "badprof.yaml").write_text("engine:\n  block_size: -3\n")
    (tmp_path / "badyaml.yaml").write_text("engine: [unclosed\n")
    subst = {"WL": str(wl), "MISSING": str(tmp_path / "nope.jsonl"), "BADJSON": str(tmp_path / "bad.jsonl"),
             "BADPROFILE": str(tmp_path / "badprof.yaml"), "BADYAML": str(tmp_path / "badyaml.yaml")}
    r = runner.invoke(app, [subst.get(a, a) for a in args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_plan_prints_curve_and_cheapest_candidate(tmp_path) -> None:
    wl = make_wl(tmp_path, n=6)
    r = runner.invoke(app, ["plan", str(wl), "--json", str(tmp_path / "p.json"), "--out", str(tmp_path / "o"),
                            "--kv-cache-tokens", "2000", "-c", "2", "--chunk-size", "16"])
    assert r.exit_code == 0, r.output
    p = json.loads((tmp_path / "p.json").read_text())
    assert 0 < p["ideal_hit_rate"] < 1 and p["knee_bytes"] > 0 and p["curve"]
    assert p["best"] is not None and p["best"]["meets"] and (tmp_path / "o" / "mrc.png").is_file()
    r = runner.invoke(app, ["plan", str(wl), "--target", "1.5"])
    assert r.exit_code == 2 and "--target" in r.output


def test_calibrate_against_a_fake_server_writes_a_loadable_profile(tmp_path, virtual_time, monkeypatch) -> None:
    import kvtier.sim.calibrate as sim_calibrate
    from kvtier.sim.profile import load_profile
    from tests.unit.fake_openai_server import FakeBehavior
    # the server probes in virtual time (tests/unit/virtual_time.py): the measured decode step is the fake's
    # token delay, not that plus a loaded machine's scheduling delays (the RAM/disk probes keep real time)
    monkeypatch.setattr(sim_calibrate, "make_http_client", virtual_time.http_client)
    with virtual_time.server(FakeBehavior(first_token_delay_s=0.02, token_delay_s=0.004)) as srv:
        r = runner.invoke(app, ["calibrate", "--base-url", srv.url, "--out", str(tmp_path / "p.yaml"),
                                "--lengths", "64,256", "--repeats", "1", "--decode-tokens", "6",
                                "--probe-mib", "8", "--disk-path", str(tmp_path / "disk"),
                                "--json", str(tmp_path / "m.json")])
    assert r.exit_code == 0, r.output
    p = load_profile(tmp_path / "p.yaml")
    m = json.loads((tmp_path / "m.json").read_text())["measurements"]
    assert len(m["prefill"]) == 4 and len(m["decode"]) == 2
    assert p.engine.step_overhead_s + p.engine.decode_seq_s == pytest.approx(0.004, abs=0.004)
    assert p.ram.read_bw > 0 and p.ssd.read_bw > 0 and not list((tmp_path / "disk").iterdir())
    assert "fake-model" in p.description


def test_calibrate_unreachable_server_is_one_line(tmp_path) -> None:
    from kvtier.ports import free_port
    r = runner.invoke(app, ["calibrate", "--base-url", f"http://127.0.0.1:{free_port()}", "--out",
                            str(tmp_path / "p.yaml"), "--request-timeout", "5"])
    assert r.exit_code == 2 and "cannot reach" in r.output and len(r.output.strip().splitlines()) == 1


def test_plan_with_a_preset_profile_as_the_readme_writes_it(tmp_path) -> None:
    """`kvtier plan wl.jsonl --profile h100/llama-3-8b` (README): a preset names the engine's KV space."""
    wl = make_wl(tmp_path, n=6)
    r = runner.invoke(app, ["plan", str(wl), "--profile", "h100/llama-3-8b", "--json", str(tmp_path / "p.json"),
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["chunk_bytes"] == 256 * 128 * 1024      # the preset's Llama-3-8B KV (128 KiB/token), 256-token chunks
    assert p["curve"] and p["candidates"] and p["best"] is not None
