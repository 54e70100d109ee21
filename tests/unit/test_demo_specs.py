"""The demos' server configurations are valid kvtier configs with the documented sizing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.config import KvtierConfig, deep_merge
from kvtier.demo import companion
from kvtier.demo.common import DEMO_CHUNK_TOKENS, ModelFacts, model_facts
from kvtier.demo.sizing import WorkloadFacts

FACTS = ModelFacts(path=Path("/nonexistent/model"), kv_bytes_per_token=23_040, max_model_len=8192)
WF = WorkloadFacts(requests=104, prompt_tokens=162_213, ideal_hit_tokens=129_536, think_s=500.0, max_prompt_tokens=3900)


def _validate(cfg: dict, tmp_path: Path) -> KvtierConfig:
    """As `run_compare` does: an SSD configuration gets a fresh directory at run time."""
    if cfg["store"].get("disk", {}).get("enabled"):
        cfg = deep_merge(cfg, {"store": {"disk": {"path": str(tmp_path / "ssd")}}})
    return KvtierConfig.model_validate(cfg)


def test_companion_specs_share_engine_sizing_and_ram_budget(tmp_path):
    b = companion.budgets(companion.DEFAULT, FACTS, WF)
    specs = companion.server_specs(companion.DEFAULT, FACTS, b)
    assert [s.name for s in specs] == ["vanilla", "kvtier-ram", "kvtier-ram-ssd"]
    assert len({(s.max_model_len, s.kv_cache_space_gib, s.dtype) for s in specs}) == 1
    assert specs[0].kvtier_config is None
    ws = WF.working_set_tokens
    assert b.ram_tokens == int(ws * companion.DEFAULT.ram_fraction) and b.ssd_tokens >= ws
    for s in specs[1:]:
        cfg = _validate(s.kvtier_config, tmp_path)
        assert cfg.store.chunk_size == DEMO_CHUNK_TOKENS
        assert cfg.store.memory.capacity == b.ram_tokens * FACTS.kv_bytes_per_token
    assert not _validate(specs[1].kvtier_config, tmp_path).store.disk.enabled
    assert _validate(specs[2].kvtier_config, tmp_path).store.disk.capacity == b.ssd_tokens * FACTS.kv_bytes_per_token


@pytest.mark.parametrize("history, saves", [("live", True), ("workload", False)])
def test_generated_chunks_are_saved_only_when_the_history_sends_replies_back(tmp_path, history, saves):
    b = companion.budgets(companion.DEFAULT, FACTS, WF)
    for s in companion.server_specs(companion.DEFAULT, FACTS, b, history)[1:]:
        assert _validate(s.kvtier_config, tmp_path).connector.save_generated is saves


def test_budgets_are_tokens_so_every_dtype_holds_the_same_share_of_the_working_set():
    """bf16 and float32: the same capacities in tokens, bytes = tokens x the dtype's KV bytes per token."""
    bf16 = dataclasses.replace(FACTS, kv_bytes_per_token=23_040, dtype="bfloat16")
    f32 = dataclasses.replace(FACTS, kv_bytes_per_token=46_080, dtype="float32")
    b16, b32 = (companion.budgets(companion.DEFAULT, f, WF) for f in (bf16, f32))
    assert (b16.engine_kv_tokens, b16.ram_tokens, b16.ssd_tokens) == (b32.engine_kv_tokens, b32.ram_tokens,
                                                                        b32.ssd_tokens)
    assert b16.engine_kv_tokens == -(-int(WF.working_set_tokens * companion.DEFAULT.engine_kv_fraction) // 128) * 128
    s16, s32 = (companion.server_specs(companion.DEFAULT, f, b)[2] for f, b in ((bf16, b16), (f32, b32)))
    assert s32.kv_cache_space_gib == pytest.approx(2 * s16.kv_cache_space_gib)
    assert s32.kvtier_config["store"]["memory"]["capacity"] == 2 * s16.kvtier_config["store"]["memory"]["capacity"]
    assert (s16.dtype, s32.dtype) == ("bfloat16", "float32")


def test_model_facts_follow_the_dtype(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, '
                                          '"num_hidden_layers": 30, "max_position_embeddings": 8192}')
    assert model_facts(tmp_path, "bfloat16").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert model_facts(tmp_path, "float32").kv_bytes_per_token == 46_080


def test_demo_chunk_is_a_multiple_of_the_cpu_block_size():
    assert DEMO_CHUNK_TOKENS % 128 == 0


def test_quick_is_smaller_than_default():
    q, d = companion.QUICK, companion.DEFAULT
    assert q.conversations <= d.conversations and q.target_s < d.target_s
    assert (q.engine_kv_fraction, q.ram_fraction) == (d.engine_kv_fraction, d.ram_fraction)   # the same experiment
    assert q.concurrency / q.conversations == d.concurrency / d.conversations
    for s in (q, d):   # the truncated geometric turn-count distribution cannot reach a larger mean
        assert s.turns_mean < (1 + s.turns_max) / 2


def test_demo_rejects_bad_sizes_with_one_clear_error():
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd

    app = typer.Typer()
    demo_cmd.register(app)

    for args, name in ((["demo", "--users", "0"], "--users"), (["demo", "--conversations", "-3"], "--conversations"),
                       (["demo", "--minutes", "0"], "--minutes"), (["demo", "--dtype", "int4"], "--dtype")):
        res = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
        assert res.exit_code == 2
        assert name in res.output


def test_an_unreadable_calibration_is_one_line_and_exit_1(tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd
    from kvtier.demo import common

    monkeypatch.setattr("kvtier.model.ensure_model", lambda: tmp_path)
    monkeypatch.setattr(common, "model_facts", lambda path, dtype: ModelFacts(path, 46_080, 8192, dtype))
    app = typer.Typer()
    demo_cmd.register(app)
    res = CliRunner().invoke(app, ["demo", "--dtype", "float32", "--calibration", str(tmp_path / "nope.json"),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 1 and "cannot read a calibration" in res.output and "Traceback" not in res.output


def test_longdoc_sharedfs_column_runs_on_a_fresh_server_with_empty_local_tiers(tmp_path) -> None:
    from kvtier.config import deep_merge, load_config
    from kvtier.demo.longdoc import COLUMNS, sharedfs_columns

    cols = sharedfs_columns(tmp_path / "m1", tmp_path / "m2")
    assert [c.key for c in cols[:-1]] == [c.key for c in COLUMNS]
    last = cols[-1]
    assert last.tier == "sharedfs" and last.server > max(c.server for c in COLUMNS)
    base = {"store": {"disk": {"enabled": True, "path": str(tmp_path / "ssd")}}}
    writer = load_config(overrides=deep_merge(base, cols[0].kvtier)).store
    reader = load_config(overrides=deep_merge(base, last.kvtier)).store
    assert writer.shared.path == tmp_path / "m1" and writer.disk.enabled
    assert reader.shared.path == tmp_path / "m2" and not reader.disk.enabled
