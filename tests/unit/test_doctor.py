"""`kvtier doctor` reports a missing model clearly and exits non-zero."""

from __future__ import annotations

import subprocess
import sys


def _doctor(env_extra: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **env_extra)
    env.pop("KVTIER_MODEL_DIR", None) if "KVTIER_MODEL_DIR" not in env_extra else None
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--no-load"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_doctor_reports_missing_model_in_empty_cache_dir(tmp_path):
    home = tmp_path / "empty-cache"
    home.mkdir()
    proc = _doctor({"KVTIER_HOME": str(home), "COLUMNS": "200"}, tmp_path)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("problem:")]
    assert len(lines) == 1, proc.stderr
    assert "does not exist" in lines[0] and str(home) in lines[0]


def test_doctor_reports_incomplete_model_folder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = _doctor({"KVTIER_MODEL_DIR": str(model), "COLUMNS": "200"}, tmp_path)
    assert proc.returncode == 1
    assert "incomplete" in proc.stderr and "tokenizer.json" in proc.stderr
