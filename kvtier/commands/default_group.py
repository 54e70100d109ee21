"""A command group with a default sub-command: ``kvtier demo [OPTIONS]`` = ``kvtier demo companion [OPTIONS]``.

Contract: when the first word after the group is not one of its sub-commands (no words at all, or an
option other than ``--help``), the default sub-command's name is put in front, so the group's bare form
takes exactly the default command's options. ``kvtier demo --help`` still shows the group's help.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperGroup


class DefaultCommandGroup(TyperGroup):
    """A group whose bare invocation (or one starting with an option) runs ``default_command``."""

    default_command: str = ""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        first = args[0] if args else None
        help_names = getattr(ctx, "help_option_names", ["--help"])
        if self.default_command and (first is None or (first.startswith("-") and first not in help_names)):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def default_group(name: str) -> type[DefaultCommandGroup]:
    """A group class (for ``typer.Typer(cls=...)``) whose default sub-command is ``name``."""
    return type("DefaultCommandGroup", (DefaultCommandGroup,), {"default_command": name, "__module__": __name__})
