"""The seeded tiny checkpoints: specs keyed by a content hash, made once, refused when greedy output does not vary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.models import DEFAULT, ModelError
from kvtier.models import tiny as tiny_mod
from kvtier.models.tiny import MARKER, TINY, TinySpec, ensure_tiny, make_tiny, tiny_spec, varied


def test_the_five_architectures_and_their_serving_needs():
    assert set(TINY) == {"mistral-swa", "llama-kv4", "deepseek-mla", "qwen3-next", "gemma3-tiny"}
    assert dict(TINY["mistral-swa"].fields)["sliding_window"] == 256
    assert dict(TINY["llama-kv4"].fields)["num_key_value_heads"] == 4
    mla = dict(TINY["deepseek-mla"].fields)
    assert (mla["kv_lora_rank"], mla["qk_rope_head_dim"], TINY["deepseek-mla"].block_size) == (512, 64, 16)
    assert TINY["qwen3-next"].serve_dtype == "bfloat16"
    assert "linear_attention" in dict(TINY["qwen3-next"].fields)["layer_types"]
    with pytest.raises(ModelError, match="unknown tiny model 'gpt'"):
        tiny_spec("gpt")


def test_the_folder_is_keyed_by_a_content_hash_of_the_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    spec = TINY["mistral-swa"]
    same = dataclasses.replace(spec, notes="words do not shape weights")
    assert same.digest() == spec.digest() and same.path() == spec.path()
    for changed in (dataclasses.replace(spec, std=0.05), dataclasses.replace(spec, seed=1),
                    dataclasses.replace(spec, fields=spec.fields + (("num_hidden_layers", 3),))):
        assert changed.digest() != spec.digest()
    assert spec.path().parent == tmp_path / "models" / "tiny" and spec.path().name.startswith("mistral-swa-")
    assert len({s.digest() for s in TINY.values()}) == len(TINY)


def test_varied_rejects_two_tokens_alternating():
    assert not varied([5, 9] * 6) and not varied([7] * 12)
    assert varied([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4])


def test_ensure_is_idempotent_once_the_marker_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    folder = TINY["llama-kv4"].path()
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    monkeypatch.setattr(tiny_mod, "make_tiny", lambda spec, dest: pytest.fail("made again"))
    assert ensure_tiny("llama-kv4") == folder


def _bundled_tokenizer() -> Path:
    path = DEFAULT.path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the bundled model is not prepared here (make setup)")
    return path


def test_a_made_checkpoint_varies_and_a_flat_one_is_refused_unpublished(tmp_path, monkeypatch):
    tok = _bundled_tokenizer()
    monkeypatch.setenv("KVTIER_MODEL_DIR", str(tok))
    small = TinySpec("mistral-small", "mistral", (("hidden_size", 64), ("intermediate_size", 128),
                                                  ("num_attention_heads", 2), ("head_dim", 32),
                                                  ("num_key_value_heads", 1), ("num_hidden_layers", 1),
                                                  ("sliding_window", 256)), std=0.2)
    made = make_tiny(small, tmp_path / "ok")
    assert (made / MARKER).is_file() and (made / "tokenizer.json").is_file() and any(made.glob("*.safetensors"))
    monkeypatch.setattr(tiny_mod, "greedy_tokens", lambda folder: [5, 9] * 6)    # a degenerate checkpoint
    with pytest.raises(ModelError, match=r"mistral-small: greedy output does not vary \(\[5, 9, 5"):
        make_tiny(small, tmp_path / "flat")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]      # nothing published, no temp left
