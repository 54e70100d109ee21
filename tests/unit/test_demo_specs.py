"""The demos' server configurations are valid kvtier configs with the documented sizing."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import KvtierConfig, deep_merge
from kvtier.demo import companion
from kvtier.demo.common import DEMO_CHUNK_TOKENS, ModelFacts

FACTS = ModelFacts(path=Path("/nonexistent/model"), kv_bytes_per_token=23_040, max_model_len=8192)


def _validate(cfg: dict, tmp_path: Path) -> KvtierConfig:
    """As `run_compare` does: an SSD configuration gets a fresh directory at run time."""
    if cfg["store"].get("disk", {}).get("enabled"):
        cfg = deep_merge(cfg, {"store": {"disk": {"path": str(tmp_path / "ssd")}}})
    return KvtierConfig.model_validate(cfg)


def test_companion_specs_share_engine_sizing_and_ram_budget(tmp_path):
    ws = 1_000 * 2**20
    specs, ram, ssd = companion.server_specs(companion.DEFAULT, FACTS, ws)
    assert [s.name for s in specs] == ["vanilla", "kvtier-ram", "kvtier-ram-ssd"]
    assert len({(s.max_model_len, s.kv_cache_space_gib) for s in specs}) == 1
    assert specs[0].kvtier_config is None
    assert ram == int(ws * companion.DEFAULT.ram_fraction) and ssd >= ws
    for s in specs[1:]:
        cfg = _validate(s.kvtier_config, tmp_path)
        assert cfg.store.chunk_size == DEMO_CHUNK_TOKENS
        assert cfg.store.memory.capacity == ram
    assert not _validate(specs[1].kvtier_config, tmp_path).store.disk.enabled
    assert _validate(specs[2].kvtier_config, tmp_path).store.disk.capacity == ssd


def test_demo_chunk_is_a_multiple_of_the_cpu_block_size():
    assert DEMO_CHUNK_TOKENS % 128 == 0


def test_quick_is_smaller_than_default():
    q, d = companion.QUICK, companion.DEFAULT
    assert q.conversations <= d.conversations and q.duration_s <= d.duration_s


def test_demo_rejects_bad_sizes_with_one_clear_error():
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd

    app = typer.Typer()
    demo_cmd.register(app)

    for args, name in ((["demo", "--users", "0"], "--users"), (["demo", "--conversations", "-3"], "--conversations")):
        res = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
        assert res.exit_code == 2
        assert name in res.output
