"""Deprecated option names kept as hidden aliases of the canonical ones.

A command registered with ``cls=aliased(...)`` rewrites each old option name on its command line to
the canonical name before parsing and prints one line per old name on stderr::

    app.command("run", cls=aliased(REPLAY))(run)      # --url X -> --base-url X

Contract: an alias is never a click option, so it never appears in ``--help``; the rewritten command
line parses exactly as if the canonical name had been typed (same value, same validation, same
errors). Only arguments before ``--`` are rewritten, and only whole names (``--rate`` and
``--rate=2``, never ``--rate-limit``). An alias with ``implied`` stands for an old *switch* whose
canonical option takes a value: ``--json`` alone (at the end, before another option, or before an
existing directory, which cannot be a JSON file) becomes ``--json -``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import typer
from typer.core import TyperCommand


@dataclass(frozen=True)
class Alias:
    """``old`` is accepted for ``new``; ``implied``: the value an old switch form stands for."""

    old: str
    new: str
    implied: str | None = None

    def note(self) -> str:
        if self.implied is not None and self.old == self.new:
            return f"note: {self.old} without a value is deprecated; use {self.new} {self.implied}"
        return f"note: {self.old} is deprecated; use {self.new}"


# The renames shared by several commands (spec: "one CLI vocabulary").
BASE_URL = {"--url": "--base-url"}
LOAD = {"--concurrency": "--max-concurrency", "--rate": "--request-rate"}
REPLAY = {**BASE_URL, **LOAD}
STEP_TOKENS = {"--step-tokens": "--max-num-batched-tokens"}       # kvtier demo companion
MAX_BATCHED = {"--max-batched": "--max-num-batched-tokens"}       # kvtier bench ttft
SHAREDFS = {"--shared-dir": "--sharedfs", "--shared-dir-other": "--sharedfs-read",
            "--shared-evict": "--sharedfs-evict"}
JSON_SWITCH = Alias("--json", "--json", implied="-")


def _as_aliases(spec: Mapping[str, str] | Iterable[Alias]) -> tuple[Alias, ...]:
    if isinstance(spec, Mapping):
        return tuple(Alias(old, new) for old, new in spec.items())
    return tuple(spec)


def _is_switch_use(nxt: str | None) -> bool:
    """Whether the word after an old switch is not its value (absent, an option, or a directory)."""
    if nxt is None:
        return True
    if nxt.startswith("-") and nxt != "-":
        return True
    return os.path.isdir(nxt)


def rewrite(args: list[str], aliases: Iterable[Alias], note: Callable[[str], Any] | None = None) -> list[str]:
    """``args`` with every old option name replaced by its canonical one (``note`` is told each, once)."""
    by_old = {a.old: a for a in aliases}
    out: list[str] = []
    said: set[str] = set()
    for i, arg in enumerate(args):
        if arg == "--":
            out.extend(args[i:])
            break
        name, eq, value = arg.partition("=")
        alias = by_old.get(name) if name.startswith("--") else None
        if alias is None:
            out.append(arg)
            continue
        if alias.implied is not None:
            if eq or not _is_switch_use(args[i + 1] if i + 1 < len(args) else None):
                if alias.old == alias.new:       # the canonical form with a value: nothing old here
                    out.append(arg)
                    continue
                out.append(alias.new + (eq + value if eq else ""))
            else:
                out.extend([alias.new, alias.implied])
        else:
            out.append(alias.new + eq + value)
        if note is not None and alias.old not in said:
            said.add(alias.old)
            note(alias.note())
    return out


class AliasedCommand(TyperCommand):
    """A typer command that accepts the hidden old names in ``aliases`` (see the module docstring)."""

    aliases: tuple[Alias, ...] = ()

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        quiet = getattr(ctx, "resilient_parsing", False)
        return super().parse_args(ctx, rewrite(list(args), self.aliases,
                                               None if quiet else (lambda m: typer.echo(m, err=True))))


def aliased(*specs: Mapping[str, str] | Iterable[Alias] | Alias) -> type[AliasedCommand]:
    """A command class (for ``app.command(cls=...)``) accepting these old names; later specs win."""
    merged: dict[str, Alias] = {}
    for spec in specs:
        for a in ((spec,) if isinstance(spec, Alias) else _as_aliases(spec)):
            merged[a.old] = a
    return type("AliasedCommand", (AliasedCommand,), {"aliases": tuple(merged.values()), "__module__": __name__})


def alias_table(command: Any) -> tuple[Alias, ...]:
    """The aliases of a built click command (empty for any other command)."""
    return tuple(getattr(command, "aliases", ()))
