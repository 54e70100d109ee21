"""Byte sizes on the command line (``8GiB``, ``512MiB``, ``1.5e9``): one parser and one error for every flag."""

from __future__ import annotations

import typer


def cli_size(value: str | None, flag: str) -> int | None:
    """Bytes of ``value`` (``kvtier.config.parse_size``); None stays None; a bad size is a
    ``typer.BadParameter`` naming ``flag``."""
    from kvtier.config import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from None
