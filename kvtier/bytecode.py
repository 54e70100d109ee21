"""Is the environment byte-compiled? (``kvtier doctor``, the set-up test.)

Every vLLM server is three Python processes (API server, engine core, worker), each importing
torch, vllm and transformers (~7,000 modules). Where ``PYTHONDONTWRITEBYTECODE`` is set, Python never
caches what it compiles, so without ``.pyc`` files each process compiles them all again: 34 s of
imports instead of 16 s on a 2-vCPU AVX2 machine. ``scripts/setup.sh`` runs ``compileall`` once.
Side-effect free: nothing is imported, only files are looked at.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

#: modules every vLLM server process imports; their .pyc decide the start time
HEAVY = ("torch", "torch._dynamo.symbolic_convert", "transformers", "vllm", "vllm.config.model",
         "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core")


def source_of(name: str) -> Path | None:
    """The source file of module ``name``, found without importing anything (``find_spec`` of a
    top-level name does not import it; of a submodule it would import the parents)."""
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    base = Path(spec.origin).parent.joinpath(*rest.split(".")) if rest else Path(spec.origin).parent
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def stale_bytecode(source: Path) -> str | None:
    """Why ``source`` has no usable .pyc ("missing", "older than its source"), or None when it has one."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.exists():
        return "missing"
    if cached.stat().st_mtime < source.stat().st_mtime - 1:
        return "older than its source"
    return None


@dataclass(frozen=True)
class BytecodeStatus:
    checked: tuple[str, ...]                 # modules found here
    stale: tuple[tuple[str, str], ...]       # (module, why) without a usable .pyc
    writes_bytecode: bool                    # False when PYTHONDONTWRITEBYTECODE / -B is in effect

    @property
    def slow_starts(self) -> bool:
        """Every process will compile these modules again (nothing caches them)."""
        return bool(self.stale) and not self.writes_bytecode


def bytecode_status(names: tuple[str, ...] = HEAVY) -> BytecodeStatus:
    checked, stale = [], []
    for name in names:
        src = source_of(name)
        if src is None:
            continue
        checked.append(name)
        why = stale_bytecode(src)
        if why:
            stale.append((name, why))
    return BytecodeStatus(tuple(checked), tuple(stale), not sys.flags.dont_write_bytecode)
