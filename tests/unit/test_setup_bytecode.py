"""scripts/setup.sh leaves the environment byte-compiled; kvtier.bytecode tells.

On machines with PYTHONDONTWRITEBYTECODE=1 (these have it) Python never caches what it compiles, and
setup installs with pip's --no-compile; without the explicit compileall step every vLLM process (three
per server) recompiled torch, vllm and transformers from source: 34 s of imports instead of 16 s, about
half of each of the suite's ~25 server starts (85-90 s per start in CI without it, ~45 s with it).
Shown to fail without the step: with one .pyc of a fresh CI venv moved away, the test of that module fails.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from kvtier.bytecode import HEAVY, bytecode_status, source_of, stale_bytecode


@pytest.mark.parametrize("name", HEAVY)
def test_heavy_modules_have_current_bytecode(name):
    if importlib.util.find_spec(name.split(".")[0]) is None:
        pytest.skip(f"{name.split('.')[0]} is not installed here")
    source = source_of(name)
    assert source is not None, f"no source file for {name}"
    assert stale_bytecode(source) is None, f"{name}: .pyc {stale_bytecode(source)}: run scripts/setup.sh (compileall)"


def test_status_names_missing_and_stale_bytecode(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    (pkg / "sub").mkdir(parents=True)
    for f in (pkg / "__init__.py", pkg / "sub" / "__init__.py", pkg / "sub" / "mod.py", pkg / "old.py"):
        f.write_text("x = 1\n")
    import py_compile
    py_compile.compile(str(pkg / "old.py"), cfile=importlib.util.cache_from_source(str(pkg / "old.py")))
    later = time.time() + 60
    os.utime(pkg / "old.py", (later, later))                 # source edited after compiling
    py_compile.compile(str(pkg / "__init__.py"), cfile=importlib.util.cache_from_source(str(pkg / "__init__.py")))
    monkeypatch.syspath_prepend(str(tmp_path))
    st = bytecode_status(("fakepkg", "fakepkg.sub.mod", "fakepkg.old", "fakepkg.absent", "no_such_top_level"))
    assert st.checked == ("fakepkg", "fakepkg.sub.mod", "fakepkg.old")
    assert st.stale == (("fakepkg.sub.mod", "missing"), ("fakepkg.old", "older than its source"))
    assert source_of("fakepkg.sub") == Path(pkg / "sub" / "__init__.py")


def test_doctor_row_warns_only_when_nothing_will_cache_the_bytecode():
    from kvtier.bytecode import BytecodeStatus
    from kvtier.commands.doctor_cmd import bytecode_row

    stale = (("vllm", "missing"),)
    assert bytecode_row(BytecodeStatus(("vllm",), (), False))[2] is None
    assert bytecode_row(BytecodeStatus(("vllm",), stale, True))[2] is None          # cached on first import
    label, value, warning = bytecode_row(BytecodeStatus(("vllm",), stale, False))
    assert "PYTHONDONTWRITEBYTECODE" in value and "compileall" in warning and "\n" not in warning
