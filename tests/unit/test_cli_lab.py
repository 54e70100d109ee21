"""Every lab command through the real ``kvtier`` app, on each kind of workload it accepts
(text chat, token ids, mixed), and one test per class of bad input: a one-line error that
names the problem, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier import cli
from kvtier.model import model_status
from kvtier.workload.format import Conversation, Turn, WorkloadHeader, load_workload, write_workload
from tests.unit.fake_openai_server import FakeBehavior, FakeOpenAIServer

ROOT = Path(__file__).resolve().parents[2]
HAVE_MODEL = model_status().ready


@pytest.fixture(scope="module")
def app():
    if not cli.app.registered_groups or not any(c.name == "fsck" for c in cli.app.registered_commands):
        cli._register_all()
    return cli.app


@pytest.fixture(autouse=True)
def _dtype_said_per_test(monkeypatch):
    """``--dtype`` is announced once per process: keep this module from silencing other modules' runs."""
    import kvtier.compute as compute
    monkeypatch.setattr(compute, "_announced", set(compute._announced))


def _run(app, *args: str):
    return CliRunner().invoke(app, list(args))


def _one_line_error(r, needle: str, code: int | None = None) -> None:
    """Non-zero exit, no exception escaped (so no traceback), one message on stderr naming the problem.
    Usage errors keep click's frame (a usage line, a --help hint, the message boxed and wrapped to the
    terminal): the message is unwrapped before it is compared."""
    assert r.exit_code != 0, r.output
    if code is not None:
        assert r.exit_code == code, (r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    err = r.stderr.strip()
    assert "Traceback" not in r.output and "Traceback" not in err, err
    lines = [ln.strip(" │") for ln in err.splitlines()
             if not ln.startswith(("Usage:", "Try ")) and not set(ln.strip()) <= set("╭─╮│╰╯ Error")]
    msg = " ".join(ln.strip() for ln in lines)
    assert needle in msg, err
    if not err.startswith("Usage:"):
        assert len(lines) == 1, err


# ------------------------------------------------------------------ workloads of each kind

def _text_workload(path: Path) -> Path:
    convs = [Conversation(id=f"t{i}", system=f"persona {i} " * 20,
                          turns=[Turn(user=f"question {k} of {i} " * 8, assistant=f"answer {k}", max_tokens=4)
                                 for k in range(3)]) for i in range(3)]
    write_workload(path, WorkloadHeader(name="text"), convs)
    return path


def _token_workload(path: Path) -> Path:
    convs = [Conversation(id=f"k{i}", turns=[Turn(prompt_token_ids=[1000 + (j % 300) for j in range(300 + 50 * i)],
                                                  max_tokens=4)]) for i in range(4)]
    write_workload(path, WorkloadHeader(name="tokens"), convs)
    return path


def _mixed_workload(path: Path) -> Path:
    convs = [Conversation(id="m0", turns=[Turn(user="hello there " * 10, max_tokens=4),
                                          Turn(user="and again " * 10, max_tokens=4)]),
             Conversation(id="m1", turns=[Turn(prompt_token_ids=list(range(1000, 1400)), max_tokens=4)]),
             Conversation(id="m2", turns=[Turn(prompt_token_ids=list(range(1000, 1300)), max_tokens=4),
                                          Turn(user="a text turn after a token-id turn", max_tokens=4)])]
    write_workload(path, WorkloadHeader(name="mixed"), convs)
    return path


KINDS = {"text": _text_workload, "tokens": _token_workload, "mixed": _mixed_workload}


@pytest.fixture(params=sorted(KINDS))
def workload(request, tmp_path) -> Path:
    return KINDS[request.param](tmp_path / f"{request.param}.jsonl")


@pytest.mark.parametrize("tokenizer", [None, "default"])
def test_workload_stats_on_each_kind(app, workload, tokenizer, tmp_path):
    if tokenizer == "default" and not HAVE_MODEL:
        pytest.skip("the bundled model is not prepared (make setup)")
    js = tmp_path / "s.json"
    args = ["workload", "stats", str(workload), "--block-size", "64", "--json", str(js)]
    r = _run(app, *args, *(["--tokenizer", tokenizer] if tokenizer else []))
    assert r.exit_code == 0, r.output
    st = json.loads(js.read_text())
    assert st["requests"] == sum(len(c.turns) for c in load_workload(workload).conversations)
    assert st["total_prompt_tokens"] > 0


@pytest.mark.skipif(not HAVE_MODEL, reason="the bundled model is not prepared (make setup)")
def test_stats_default_tokenizer_on_imported_mooncake_trace(app, tmp_path):
    """The reported crash: every prompt is token ids, so the batch of text prompts to render is empty
    (IndexError in render_chat_many before the fix)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 4,
                                         "hash_ids": [1, 2 + i % 3]}) + "\n" for i in range(70)))
    out = tmp_path / "m.jsonl"
    assert _run(app, "workload", "import", "mooncake", str(trace), "--mooncake-scale", "16",
                "--out", str(out)).exit_code == 0
    r = _run(app, "workload", "stats", str(out), "--tokenizer", "default", "--block-size", "16")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "ideal prefix hit rate" in r.stdout


def test_workload_generators_and_importers(app, tmp_path):
    c = tmp_path / "c.jsonl"
    assert _run(app, "workload", "companion", "--conversations", "3", "--out", str(c)).exit_code == 0
    assert load_workload(c).conversations[0].turns[0].user is not None
    if HAVE_MODEL:
        d = tmp_path / "d.jsonl"
        r = _run(app, "workload", "longdoc", "--documents", "2", "--doc-tokens", "200", "--questions", "2",
                 "--max-prompt-tokens", "600", "--tokenizer", "default", "--out", str(d))
        assert r.exit_code == 0, r.output
        assert len(load_workload(d).conversations) == 4  # 2 documents x 2 questions
    s = tmp_path / "s.jsonl"
    r = _run(app, "workload", "import", "sharegpt", str(ROOT / "tests" / "fixtures" / "sharegpt_small.json"),
             "--out", str(s))
    assert r.exit_code == 0, r.output
    assert len(load_workload(s).conversations) >= 3


def test_bench_run_on_each_kind(app, workload, tmp_path):
    n = sum(len(c.turns) for c in load_workload(workload).conversations)
    with FakeOpenAIServer.start(FakeBehavior()) as srv:
        r = _run(app, "bench", "run", str(workload), "--base-url", srv.url, "--max-concurrency", "2",
                 "--no-progress",
                 "--out", str(tmp_path / "o"), "--json", str(tmp_path / "s.json"))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["requests_ok"] == n and s["requests_failed"] == 0


def test_bench_slo_on_each_kind(app, workload, tmp_path):
    with FakeOpenAIServer.start(FakeBehavior()) as srv:
        r = _run(app, "bench", "slo", str(workload), "--base-url", srv.url, "--slo", "10", "--max-load", "2",
                 "--requests-per-point", "4", "--out", str(tmp_path / "slo"), "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r.json").read_text())["best_load"] == 2


@pytest.mark.parametrize("args,needle", [
    (["bench", "run", "{wl}", "--base-url", "http://127.0.0.1:9", "--mode", "sideways"], "--mode"),
    (["bench", "run", "{wl}", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "0"], "concurrency"),
    (["bench", "run", "{wl}", "--base-url", "http://127.0.0.1:9", "--mode", "open"], "rate"),
    (["bench", "slo", "{wl}", "--base-url", "http://127.0.0.1:9", "--mode", "trace"], "--mode"),
    (["bench", "slo", "{wl}", "--base-url", "http://127.0.0.1:9", "--slo", "-1"], "slo"),
    (["bench", "compare", "{wl}", "--configs", "/nonexistent/c.yaml"], "compare config not found"),
    (["demo", "--users", "0"], "--users"),
    (["demo", "--conversations", "5000"], "--conversations"),
    (["demo", "sideways"], "sideways"),
    (["workload", "companion", "--out", "x.jsonl", "--conversations", "0"], "--conversations"),
    (["workload", "stats", "{wl}", "--block-size", "0"], "--block-size"),
    (["fsck", "/nonexistent/dir"], "not a directory"),
    (["stats", "/nonexistent/dir"], "/nonexistent/dir"),
])
def test_invalid_cli_arguments(app, tmp_path, args, needle):
    wl = str(_text_workload(tmp_path / "w.jsonl"))
    r = _run(app, *(a.replace("{wl}", wl) for a in args))
    _one_line_error(r, needle)


# ------------------------------------------------------------------ bad input, one class per test

def test_invalid_config_value(app, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store:\n  chunk_size: -4\n")
    r = _run(app, "serve", "--config", str(cfg), "--dry-run")
    _one_line_error(r, "store.chunk_size", code=2)


def test_invalid_config_yaml(app, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store: [unclosed\n")
    _one_line_error(_run(app, "serve", "--config", str(cfg), "--dry-run"), "not valid YAML", code=2)


@pytest.mark.parametrize("yaml_text,needle", [
    ("store:\n  shared: {kind: floppy, path: /x}\n", "store.shared"),
    ("store:\n  eviction: random\n", "store.eviction"),
    ("store:\n  faults: {wraps: tape}\n", "store.faults.wraps"),
])
def test_unknown_tier_or_backend_name(app, tmp_path, yaml_text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    _one_line_error(_run(app, "serve", "--config", str(cfg), "--dry-run"), needle, code=2)


def test_unreadable_paths(app, tmp_path):
    _one_line_error(_run(app, "serve", "--config", str(tmp_path / "none.yaml"), "--dry-run"),
                    "config file not found", code=2)
    _one_line_error(_run(app, "workload", "stats", str(tmp_path)), str(tmp_path), code=2)  # a directory
    _one_line_error(_run(app, "bench", "run", str(tmp_path / "none.jsonl"), "--base-url", "http://127.0.0.1:9",
                         "--no-progress", "--out", str(tmp_path / "o")), "none.jsonl")
    bad_disk = tmp_path / "file-not-dir"
    bad_disk.write_text("x")
    _one_line_error(_run(app, "serve", "--disk-path", str(bad_disk / "sub"), "--dry-run"), "file-not-dir", code=2)


@pytest.mark.parametrize("content,needle", [
    ("not json at all\n", ":1:"),
    ('{"kvtier_workload": 1}\n{"id": "a", "turns": []}\n', ":2:"),
    ('{"kvtier_workload": 1}\n{"id": "a", "turns": [{"user": "x", "prompt_token_ids": [1]}]}\n', ":2:"),
    ('{"kvtier_workload": 99}\n', "version"),
])
def test_malformed_workload_file(app, tmp_path, content, needle):
    p = tmp_path / "w.jsonl"
    p.write_text(content)
    _one_line_error(_run(app, "workload", "stats", str(p)), needle, code=2)
    _one_line_error(_run(app, "bench", "run", str(p), "--base-url", "http://127.0.0.1:9", "--no-progress",
                         "--out", str(tmp_path / "o")), needle)


def test_malformed_import_files(app, tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "input_length": "many", "hash_ids": [1]}\n')
    _one_line_error(_run(app, "workload", "import", "mooncake", str(t), "--out", str(tmp_path / "o.jsonl")),
                    "t.jsonl:1", code=2)
    s = tmp_path / "s.json"
    s.write_text('{"oops": true}')
    _one_line_error(_run(app, "workload", "import", "sharegpt", str(s), "--out", str(tmp_path / "o.jsonl")),
                    "s.json", code=2)


def test_model_folder_that_is_not_a_model(app, tmp_path, monkeypatch):
    def no_exec(*a):
        raise AssertionError("serve started vLLM on a folder that is not a model")
    monkeypatch.setattr("os.execvpe", no_exec)
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "README").write_text("hello")
    for args in (["generate", "hi", "--model", str(empty)],
                 ["serve", str(empty)],
                 ["workload", "longdoc", "--out", str(tmp_path / "d.jsonl"), "--tokenizer", str(empty)]):
        _one_line_error(_run(app, *args), "not-a-model")


def test_bad_input_through_the_real_entry_point(tmp_path):
    """The installed entry point (not the test runner) prints one line and no traceback."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store:\n  memory: {capacity: lots}\n")
    p = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(cfg), "--dry-run"],
                       capture_output=True, text=True, timeout=110, cwd=ROOT)   # a niced run beside busy cores
    assert p.returncode == 2, p.stderr
    assert "store.memory.capacity" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
