"""`kvtier doctor`'s CPU / dtype / prefill rows and warnings, with faked CPUs and a fake measurement."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import typer

from kvtier.commands import doctor_cmd
from kvtier.compute import choose_dtype, facts_from
from kvtier.model import VERIFY, AnswerCheck, ModelStatus
from kvtier.prefill import PrefillError, PrefillPoint, ProbeResult, parse_result, prompt_ids

AVX2 = facts_from("model name\t: AMD EPYC 7B13\nflags\t\t: sse2 avx avx2 fma f16c\n", "AVX2")
SPR = facts_from("model name\t: Intel Xeon 8481C\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n", "AVX512")


@pytest.fixture
def ready_model(monkeypatch, tmp_path):
    """A 'ready' model whose transformers load is faked (no weights needed)."""
    import kvtier.model

    monkeypatch.setattr(kvtier.model, "model_status", lambda path=None: ModelStatus(tmp_path, True))
    fake = types.ModuleType("transformers")
    fake.AutoConfig = types.SimpleNamespace(from_pretrained=lambda p: types.SimpleNamespace(
        model_type="llama", num_hidden_layers=30, max_position_embeddings=8192))
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda p: object())
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setenv("COLUMNS", "250")
    return tmp_path


def _run(load, choice, facts, measure):
    try:
        doctor_cmd.run_doctor(load, choice, facts, measure)
        return 0
    except typer.Exit as e:
        return e.exit_code


def test_avx2_auto_prints_cpu_choice_and_measured_rate(ready_model, capsys):
    calls = []

    def measure(model, dtype, lengths, check):
        calls.append((model, dtype, lengths, check))
        return ProbeResult(dtype, [PrefillPoint(1024, 2.0)], " Paris.")

    rc = _run(True, choose_dtype("auto", facts=AVX2, env={}), AVX2, measure)
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert calls == [(str(ready_model), "float32", [1024], VERIFY)]
    for part in ("AMD EPYC 7B13", "avx2", "AVX2", "native bf16", "no (bf16 matmul is emulated", "float32",
                 "auto:", "prefill (1024 tokens, float32)", "512 tokens/s", "2.00 s",
                 "answer (float32)", "The capital of France is Paris."):
        assert part in out, part
    assert "warning" not in err


def test_native_bf16_cpu_picks_bf16(ready_model, capsys):
    rc = _run(True, choose_dtype("auto", facts=SPR, env={}), SPR, lambda m, d, n, q: ProbeResult(d, [PrefillPoint(1024, 0.5)], "Paris"))
    out, _ = capsys.readouterr()
    assert rc == 0 and "yes (amx_bf16, avx512_bf16)" in out and "prefill (1024 tokens, bfloat16)" in out


def test_forced_emulated_dtype_warns_but_passes(ready_model, capsys):
    rc = _run(True, choose_dtype("bfloat16", facts=AVX2, env={}), AVX2, lambda m, d, n, q: ProbeResult(d, [PrefillPoint(1024, 40.0)], "Paris"))
    out, err = capsys.readouterr()
    assert rc == 0
    assert "warning: dtype bfloat16 (cli) is emulated on this AVX2 CPU" in err
    assert "26 tokens/s" in out


def test_failed_measurement_is_a_problem(ready_model, capsys):
    def measure(model, dtype, lengths, check):
        raise PrefillError("the prefill probe did not finish in 900 s")

    rc = _run(True, choose_dtype("auto", facts=AVX2, env={}), AVX2, measure)
    _, err = capsys.readouterr()
    assert rc == 1 and "problem: prefill measurement failed: the prefill probe did not finish" in err


def test_wrong_answer_is_a_problem(ready_model, capsys):
    rc = _run(True, choose_dtype("float16", facts=AVX2, env={}), AVX2,
              lambda m, d, n, q: ProbeResult(d, [PrefillPoint(1024, 9.0)], "!!!!!!!!"))
    _, err = capsys.readouterr()
    assert rc == 1 and "the engine in float16 answers" in err and "computes wrong results" in err


def test_wrong_fact_after_the_answer_start_is_a_problem(ready_model, capsys):
    rc = _run(True, choose_dtype("auto", facts=SPR, env={}), SPR,
              lambda m, d, n, q: ProbeResult(d, [PrefillPoint(1024, 0.5)], " London."))
    out, err = capsys.readouterr()
    assert rc == 1 and "'The capital of France is London.'" in err and "expected 'Paris'" in err


def test_the_check_asks_for_the_fact_not_the_phrasing():
    """The bare question let bf16 on an Intel AMX CPU open with "L'Étoile, la Marseillaise, ..." (a near-tie
    at the first token, not wrong compute); the check starts the answer, so only the fact is asked."""
    assert VERIFY.answer_start.endswith("is") and VERIFY.expect.lower() not in VERIFY.answer_start.lower()
    assert VERIFY.passes(" Paris.") and VERIFY.passes(" PARIS") and not VERIFY.passes(" L'Étoile") and not VERIFY.passes(None)
    assert AnswerCheck("q", "a", "x").passes("...x...")


def test_no_load_does_not_measure(ready_model, capsys):
    def measure(*a):
        raise AssertionError("measured with --no-load")

    assert _run(False, choose_dtype("auto", facts=AVX2, env={}), AVX2, measure) == 0
    assert "present (not loaded)" in capsys.readouterr().out


def test_doctor_cli_rejects_a_bad_dtype():
    from typer.testing import CliRunner

    from kvtier.cli import _register_all, app

    _register_all()
    r = CliRunner().invoke(app, ["doctor", "--no-load", "--dtype", "fp64"])
    assert r.exit_code != 0 and "fp64" in r.output


def test_prefill_result_parsing_and_prompts():
    out = 'noise\nKVTIER_PREFILL_RESULT {"dtype": "float32", "points": [{"tokens": 1024, "seconds": 2.5}], ' \
          '"answer": "Paris"}\n'
    assert parse_result(out) == ProbeResult("float32", [PrefillPoint(1024, 2.5)], "Paris")
    for bad in ("nothing here", "KVTIER_PREFILL_RESULT {oops", 'KVTIER_PREFILL_RESULT [{"tokens": 1}]'):
        with pytest.raises(PrefillError):
            parse_result(bad)
    a, b = prompt_ids(1024, 1), prompt_ids(1024, 2)
    assert len(a) == 1024 and a[:128] != b[:128] and all(100 <= t < 49152 for t in a + b)


def test_generate_passes_the_resolved_dtype(monkeypatch, tmp_path):
    import kvtier.compute
    import kvtier.engine
    import kvtier.runtime
    from typer.testing import CliRunner

    from kvtier.cli import _register_all, app

    seen = {}

    def fake_chat(model, prompt, *, max_tokens, dtype):
        seen.update(model=model, dtype=dtype)
        return "Paris."

    monkeypatch.setattr(kvtier.engine, "offline_chat", fake_chat)
    monkeypatch.setattr(kvtier.runtime, "apply_vllm_env", lambda *a, **k: None)
    monkeypatch.setattr(kvtier.compute, "_announced", set())     # said once per process: start fresh
    monkeypatch.delenv("KVTIER_DTYPE", raising=False)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    _register_all()
    r = CliRunner().invoke(app, ["generate", "capital?", "--model", str(tmp_path), "--dtype", "float16"])
    assert r.exit_code == 0, r.output
    assert "Paris." in r.stdout and seen["dtype"].dtype == "float16" and seen["dtype"].source == "cli"
    assert "dtype float16 (cli" in r.stderr
