"""`kvtier demo longdoc --model`: the bundled model's sizing, tiers that hold every document, one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError, ModelFacts
from kvtier.demo.longdoc import DEFAULT, QUICK, LongDocDemoSize
from kvtier.demo.longdoc_models import (DEFAULT_MODEL, LONGDOC_MODELS, MIN_DISK_BYTES, MIN_MEMORY_BYTES, check_fits,
                                        longdoc_model, tier_sizes)

GEMMA_F32 = ModelFacts(Path("gemma-3-270m"), 36_864, 32_768, "float32")
SMOL_BF16 = ModelFacts(Path("SmolLM2-135M-Instruct"), 23_040, 8_192, "bfloat16")
# gemma-3-270m's config.json fields that decide its KV bytes (the converted folder's)
GEMMA_CONFIG = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                "hidden_size": 640, "max_position_embeddings": 32_768}


def _app() -> typer.Typer:
    from kvtier.commands import demo_cmd

    app = typer.Typer()
    demo_cmd.register(app)
    return app


def test_the_default_model_keeps_its_sizes_and_tiers():
    assert DEFAULT_MODEL == "smollm2"
    smol = LONGDOC_MODELS["smollm2"]
    assert smol.default is DEFAULT and smol.quick is QUICK
    t = tier_sizes(DEFAULT, SMOL_BF16)
    assert (t.memory_bytes, t.disk_bytes) == (MIN_MEMORY_BYTES, MIN_DISK_BYTES)     # 2 GiB / 8 GiB as before


def test_gemma_documents_are_in_the_published_regime_and_fit_its_context():
    g = longdoc_model("gemma3")
    assert g.default.documents == 3 and 20_000 <= g.default.doc_tokens < g.default.max_prompt_length <= 24_000
    check_fits(g.default, GEMMA_F32)
    check_fits(g.quick, GEMMA_F32)
    assert g.default.request_timeout_s >= 1800          # a cold 22K-token prefill takes minutes on 2 vCPUs


def test_gemma_tiers_hold_every_document_in_float32(tmp_path):
    from kvtier.compute import kv_bytes_per_token
    from kvtier.demo.common import model_facts

    (tmp_path / "config.json").write_text(json.dumps(GEMMA_CONFIG))
    assert kv_bytes_per_token(tmp_path, "float32") == 36_864            # 18 layers x 1 KV head x 256 x 2 x 4 B
    facts = model_facts(tmp_path, "float32")
    size = longdoc_model("gemma3").default
    t = tier_sizes(size, facts)
    docs = size.documents * -(-size.max_prompt_length // DEMO_CHUNK_TOKENS) * DEMO_CHUNK_TOKENS * 36_864
    assert t.documents_bytes == docs and t.memory_bytes >= docs > MIN_MEMORY_BYTES and t.disk_bytes >= 2 * docs


@given(documents=st.integers(1, 8), prompt=st.integers(200, 32_000), per_token=st.integers(1_000, 200_000))
def test_the_tiers_always_hold_the_documents(documents, prompt, per_token):
    size = LongDocDemoSize(documents=documents, doc_tokens=prompt - 100, max_prompt_length=prompt)
    t = tier_sizes(size, ModelFacts(Path("m"), per_token, 32_768, "float32"))
    assert t.memory_bytes >= max(t.documents_bytes, MIN_MEMORY_BYTES)
    assert t.disk_bytes >= max(2 * t.documents_bytes, MIN_DISK_BYTES) and t.disk_bytes >= t.memory_bytes


def test_documents_longer_than_the_context_are_refused_in_one_line():
    with pytest.raises(DemoError, match=r"22528-token prompts do not fit SmolLM2-135M-Instruct's 8192-token"):
        check_fits(longdoc_model("gemma3").default, SMOL_BF16)
    with pytest.raises(DemoError, match="no room for the question"):
        check_fits(LongDocDemoSize(documents=1, doc_tokens=4000, max_prompt_length=4000), SMOL_BF16)


def test_an_unknown_model_is_a_one_line_usage_error(tmp_path):
    res = CliRunner().invoke(_app(), ["demo", "longdoc", "--model", "llama9", "--out", str(tmp_path)],
                             env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--model" in res.output and "unknown model 'llama9'" in res.output and "smollm2, gemma3" in res.output


@pytest.mark.parametrize("args,name", [([], "smollm2"), (["--model", "gemma3"], "gemma3"),
                                       (["--model", "Gemma3", "--quick"], "gemma3")])
def test_the_model_option_reaches_the_demo(tmp_path, monkeypatch, args, name):
    from kvtier.commands import demo_cmd

    seen = {}
    monkeypatch.setattr(demo_cmd, "_run", lambda demo, out, js, opts, dtype, columns, sizing:
                        seen.update(demo=demo, sizing=sizing, quick=opts.quick))
    res = CliRunner().invoke(_app(), ["demo", "longdoc", *args, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen["demo"] == "longdoc" and seen["sizing"].name == name
    assert seen["sizing"].size(seen["quick"]) is (seen["sizing"].quick if "--quick" in args else seen["sizing"].default)


def test_the_records_name_the_cpu_they_were_measured_on():
    import json as _json

    from kvtier.compute import cpu_facts
    from kvtier.demo.longdoc import _cpu

    cpu = _cpu()
    assert cpu["model_name"] == cpu_facts().model_name and cpu["key_flags"] == cpu_facts().key_flags
    assert isinstance(cpu["native_bf16"], bool) and _json.loads(_json.dumps(cpu)) == cpu
