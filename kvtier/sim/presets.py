"""Named profiles (``--profile NAME``) and the lookup of a profile argument.

``resolve_profile(None)`` gives ``SimProfile()`` (defaults); a path is read as YAML; a name
is one of ``PRESETS`` (derivations in docs/simulator.md).
"""

from __future__ import annotations

from pathlib import Path

from kvtier.sim.profile import ProfileError, SimProfile, load_profile

PRESETS: dict[str, SimProfile] = {}


def resolve_profile(arg: Path | str | None) -> SimProfile:
    if arg is None:
        return SimProfile()
    name = str(arg)
    if name in PRESETS:
        return PRESETS[name].model_copy(deep=True)
    p = Path(name)
    if not p.exists() and p.suffix not in (".yaml", ".yml"):
        raise ProfileError(f"unknown profile {name!r}: not a file and not a preset "
                           f"({', '.join(sorted(PRESETS)) or 'none'})")
    return load_profile(p)
