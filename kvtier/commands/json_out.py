"""The shared ``--json PATH`` option: machine-readable output of any command; ``--json -`` is stdout.

Contract: ``write_json_out(path, data)`` writes ``data`` as indented JSON, atomically (a temporary
file in the same folder, then a rename; parent folders are created), or to stdout when ``path`` is
``-``. A command whose human output goes to stdout sends it to stderr instead when ``--json -`` is
given (``human_to_stderr``), so stdout carries nothing but the JSON document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

STDOUT = "-"


def json_option(what: str, note: str = "") -> Any:
    """``--json PATH``: write ``what`` (e.g. "the summary") as JSON to PATH, '-' for stdout."""
    return typer.Option(None, "--json", metavar="PATH",
                        help=f"Write {what} as JSON to PATH ('-': stdout){'; ' + note if note else ''}.")


def is_stdout(path: Path | str | None) -> bool:
    return path is not None and str(path) == STDOUT


def _plain(v: Any) -> Any:
    """JSON for what json.dumps does not know: numbers (numpy scalars) as floats, the rest (paths) as text."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def write_json_out(path: Path | str, data: Any) -> None:
    text = json.dumps(data, indent=2, default=_plain) + "\n"
    if is_stdout(path):
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(p)


def human_to_stderr(*consoles: Any) -> None:
    """Point these rich consoles at stderr while the running command lasts (stdout carries the
    ``--json -`` document); their own stream is given back when the command's context closes."""
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    for c in consoles:
        before = getattr(c, "_file", None)    # None: the console follows sys.stdout
        c.file = sys.stderr
        if ctx is not None:
            ctx.call_on_close(lambda c=c, before=before: setattr(c, "_file", before))
