"""kvtier.compute: CPU facts from faked /proc/cpuinfo, the dtype choice, the one KV-bytes formula."""

from __future__ import annotations

import json

import pytest

from kvtier.compute import (CpuFacts, DtypeChoice, DtypeError, choose_dtype, cpu_facts, dtype_itemsize,
                            facts_from, kv_bytes, kv_bytes_per_token, parse_cpuinfo)

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma f16c bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma f16c bmi2
"""
SAPPHIRE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16
"""
ICELAKE_AVX512_NO_BF16 = """model name\t: Intel(R) Xeon(R) Platinum 8375C
flags\t\t: avx2 avx512f avx512bw avx512vl
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve bf16 svebf16 i8mm
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""
GRAVITON2 = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


def test_parse_x86_takes_first_cpu():
    model, flags = parse_cpuinfo(EPYC_AVX2)
    assert model == "AMD EPYC 7B13"
    assert "avx2" in flags and "avx512_bf16" not in flags


def test_parse_arm_features_and_model():
    model, flags = parse_cpuinfo(GRAVITON3)
    assert {"bf16", "svebf16", "sve"} <= flags
    assert "0xd40" in model


@pytest.mark.parametrize("text,native", [(EPYC_AVX2, False), (SAPPHIRE, True), (ICELAKE_AVX512_NO_BF16, False),
                                         (GRAVITON3, True), (GRAVITON2, False), ("", False)])
def test_native_bf16_from_flags(text, native):
    assert facts_from(text, "AVX2").native_bf16 is native


def test_auto_avx2_picks_float32_and_says_why():
    c = choose_dtype(None, facts=facts_from(EPYC_AVX2, "AVX2"), env={})
    assert (c.dtype, c.source, c.emulated) == ("float32", "auto", False)
    assert "AVX2" in c.reason and "no native bf16" in c.reason
    assert choose_dtype("auto", facts=facts_from(EPYC_AVX2, "AVX2"), env={}) == c


@pytest.mark.parametrize("text", [SAPPHIRE, GRAVITON3])
def test_auto_native_bf16_picks_bfloat16(text):
    c = choose_dtype("auto", facts=facts_from(text, "AVX512"), env={})
    assert (c.dtype, c.source, c.emulated) == ("bfloat16", "auto", False)


def test_forced_bf16_on_avx2_is_emulated():
    avx2 = facts_from(EPYC_AVX2, "AVX2")
    c = choose_dtype("bfloat16", facts=avx2, env={})
    assert (c.dtype, c.source, c.emulated) == ("bfloat16", "cli", True)
    assert "emulated" in c.describe()
    assert choose_dtype("float16", facts=avx2, env={}).emulated  # f16c converts, it does not compute
    assert not choose_dtype("float32", facts=avx2, env={}).emulated
    assert not choose_dtype("bf16", facts=facts_from(SAPPHIRE, "AVX512"), env={}).emulated
    assert not choose_dtype("float16", facts=facts_from(SAPPHIRE, "AVX512"), env={}).emulated
    assert choose_dtype("float32", source="config", facts=avx2, env={}).source == "config"


def test_env_honoured_for_auto_only():
    avx2 = facts_from(EPYC_AVX2, "AVX2")
    env = {"KVTIER_DTYPE": "bfloat16"}
    c = choose_dtype("auto", facts=avx2, env=env)
    assert (c.dtype, c.source, c.emulated) == ("bfloat16", "env", True)
    assert "KVTIER_DTYPE" in c.reason
    assert choose_dtype("float32", facts=avx2, env=env).source == "cli"   # an explicit flag wins
    assert choose_dtype(None, facts=avx2, env={"KVTIER_DTYPE": "auto"}).source == "auto"
    with pytest.raises(DtypeError, match="KVTIER_DTYPE"):
        choose_dtype(None, facts=avx2, env={"KVTIER_DTYPE": "int4"})


@pytest.mark.parametrize("bad", ["int8", "fp8", "float64", ""])
def test_bad_requests_are_one_line_errors(bad):
    if bad == "":   # empty means auto
        assert choose_dtype(bad, facts=facts_from(EPYC_AVX2, "AVX2"), env={}).source == "auto"
        return
    with pytest.raises(DtypeError) as e:
        choose_dtype(bad, facts=facts_from(EPYC_AVX2, "AVX2"), env={})
    assert "\n" not in str(e.value)


def test_itemsize_names():
    assert dtype_itemsize("bfloat16") == dtype_itemsize("torch.float16") == dtype_itemsize("bf16") == 2
    assert dtype_itemsize("float32") == dtype_itemsize("fp32") == 4
    assert dtype_itemsize("fp8_e4m3") == 1
    torch = pytest.importorskip("torch")
    for t in (torch.float32, torch.bfloat16, torch.float16):
        assert dtype_itemsize(t) == t.itemsize
    with pytest.raises(DtypeError):
        dtype_itemsize("float64x")


def _model_dir(tmp_path, **over):
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "head_dim": 64}
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return tmp_path


def test_kv_bytes_per_token_smollm(tmp_path):
    d = _model_dir(tmp_path)
    assert kv_bytes_per_token(d, "bfloat16") == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(d, "float32") == 46_080
    assert kv_bytes(30, 3, 64, 4, tokens=16) == 16 * 46_080


def test_kv_bytes_per_token_derived_fields(tmp_path):
    d = _model_dir(tmp_path, head_dim=None, num_key_value_heads=None)
    assert kv_bytes_per_token(d, "float32") == 2 * 30 * 9 * 64 * 4


def test_kv_bytes_per_token_auto_follows_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DTYPE", "bfloat16")
    assert kv_bytes_per_token(_model_dir(tmp_path), "auto") == 23_040


def test_this_machine_facts_are_consistent():
    f = cpu_facts()
    assert isinstance(f, CpuFacts) and f.capability
    assert f.native_bf16 == bool(f.flags & {"avx512_bf16", "amx_bf16", "bf16", "svebf16", "sve_bf16"})
    assert isinstance(choose_dtype(), DtypeChoice)


def test_demo_model_facts_use_the_one_formula(tmp_path):
    from kvtier.demo.common import model_facts

    d = _model_dir(tmp_path, max_position_embeddings=8192)
    f = model_facts(d, "float32")
    assert (f.kv_bytes_per_token, f.max_model_len, f.dtype) == (kv_bytes_per_token(d, "float32"), 8192, "float32")
    assert model_facts(d, "bf16").kv_bytes_per_token == 23_040


def test_announce_says_a_choice_once():
    from kvtier.compute import announce

    c = DtypeChoice("float16", "cli", "test-only reason", True)
    said: list[str] = []
    assert announce(c, said.append) and not announce(c, said.append)
    assert len(said) == 1 and "float16" in said[0] and "emulated" in said[0]
