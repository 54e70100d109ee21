"""scripts/setup.sh leaves the environment byte-compiled.

On machines with PYTHONDONTWRITEBYTECODE=1 (these have it) Python never caches what it compiles, and
setup installs with pip's --no-compile; without the explicit compileall step every vLLM process (three
per server) recompiled torch, vllm and transformers from source: 34 s of imports instead of 16 s, about
half of each of the suite's ~25 server starts (CI session 5: 85-90 s per start).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# Modules every vLLM server process imports; their .pyc decides the start time.
HEAVY = ("torch", "torch._dynamo.symbolic_convert", "transformers", "vllm", "vllm.config.model",
         "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core")


def _source_of(name: str) -> Path | None:
    """The source file of module `name`, found without importing anything (find_spec of a top-level
    name does not import it; of a submodule it would import the parents, seconds for torch)."""
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin:
        return None
    base = Path(spec.origin).parent.joinpath(*rest.split(".")) if rest else Path(spec.origin).parent
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@pytest.mark.parametrize("name", HEAVY)
def test_heavy_modules_have_current_bytecode(name):
    if importlib.util.find_spec(name.split(".")[0]) is None:
        pytest.skip(f"{name.split('.')[0]} is not installed here")
    source = _source_of(name)
    assert source is not None, f"no source file for {name}"
    cached = Path(importlib.util.cache_from_source(str(source)))
    assert cached.exists(), (f"{cached} is missing: run scripts/setup.sh (its compileall step); "
                             f"PYTHONDONTWRITEBYTECODE={'set' if sys.flags.dont_write_bytecode else 'unset'}")
    # A .pyc older than its source is ignored (recompiled in memory on every import).
    assert cached.stat().st_mtime >= source.stat().st_mtime - 1, f"{cached} is older than {source}"
