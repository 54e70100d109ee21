"""`kvtier demo longdoc --shared ...` columns and the shared-backend options of the benchmarks."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from kvtier.bench.shared_seed import SharedTarget
from kvtier.commands.ttft_cmd import shared_targets


def test_each_backend_gets_a_fresh_server_with_empty_local_tiers(tmp_path: Path) -> None:
    from kvtier.config import deep_merge, load_config
    from kvtier.demo.longdoc import COLUMNS, shared_columns

    targets = shared_targets(tmp_path, None, "", "redis://127.0.0.1:1/0", "127.0.0.1:2,http://127.0.0.1:3/metadata")
    cols = shared_columns(targets)
    assert [c.key for c in cols] == [*(c.key for c in COLUMNS), "sharedfs_hit", "valkey_hit", "mooncake_hit"]
    servers = [c.server for c in cols[len(COLUMNS):]]
    assert len(set(servers)) == 3 and min(servers) > max(c.server for c in COLUMNS)   # one fresh server each
    base = {"store": {"disk": {"enabled": True, "path": str(tmp_path / "ssd")}}}
    for c in cols[len(COLUMNS):]:
        store = load_config(overrides=deep_merge(base, c.kvtier)).store
        assert not store.disk.enabled and store.shared.kind == c.tier == c.seed.kind
        assert store.shared.lookup_timeout_s == 10.0            # the bench deadlines, see shared_seed
    assert load_config(overrides=deep_merge(base, cols[len(COLUMNS)].kvtier)).store.shared.janitor is False


def test_shared_options_are_validated() -> None:
    with pytest.raises(typer.BadParameter, match="credentials"):
        shared_targets(None, None, "", "redis://:secret@127.0.0.1:6379/0", "")
    with pytest.raises(typer.BadParameter, match="MASTER,METADATA_URL"):
        shared_targets(None, None, "", "", "127.0.0.1:50051")
    with pytest.raises(typer.BadParameter, match="not a directory"):
        shared_targets(Path("/nonexistent/kv"), None, "", "", "")
    (t,) = shared_targets(Path("/"), Path("/tmp"), "/a,/b", "", "")
    assert isinstance(t, SharedTarget) and t.write["path"] == "/" and t.read["path"] == "/tmp"
    assert t.evict == ("/a", "/b")


def test_longdoc_cli_names_a_missing_endpoint(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvtier.commands import demo_cmd

    app = typer.Typer()
    demo_cmd.register(app)
    res = CliRunner().invoke(app, ["demo", "longdoc", "--shared", "mooncake", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "--mooncake" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["demo", "longdoc", "--shared", "redis", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "unknown backend" in res.output


def test_a_valkey_column_is_proved_by_admission_with_no_local_read(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kvtier.demo.common import DemoError
    from kvtier.demo.longdoc import check_hit, shared_columns

    col = shared_columns(shared_targets(None, None, "", "redis://127.0.0.1:1/0", ""))[-1]
    rec = SimpleNamespace(cached_tokens=896)
    check_hit(col, "d000", rec, 896, {"shared": 896.0}, {})            # valkey counts no reads
    with pytest.raises(DemoError, match="valkey tier"):
        check_hit(col, "d000", rec, 896, {"shared": 896.0}, {"memory": 7.0})   # a local tier served it
    with pytest.raises(DemoError, match="valkey tier"):
        check_hit(col, "d000", rec, 896, {"memory": 896.0}, {})
