"""Liberal JSON readers for dataset files: a JSON array (read item by item, so a
truncated file still yields its complete items), a JSON object (a mapping or one item), or
JSON Lines. Every problem is a ``WorkloadError`` naming the file and position."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvtier.workload.format import WorkloadError


@dataclass
class ReadReport:
    items: int = 0
    truncated: bool = False  # the array was cut off mid-item; complete items were kept


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def read_text(path: str | Path) -> tuple[Path, str]:
    p = Path(path)
    try:
        return p, p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"input file not found: {p}") from None
    except IsADirectoryError:
        raise WorkloadError(f"input is a directory, not a file: {p}") from None
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_json_items(path: str | Path, report: ReadReport | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (position label, item) from an array, a mapping (items are (key, value)
    pairs labelled by key), a single object, or JSON Lines."""
    rep = report if report is not None else ReadReport()
    p, text = read_text(path)
    start = len(text) - len(text.lstrip())
    if start == len(text):
        raise WorkloadError(f"{p}: file is empty")
    dec = json.JSONDecoder()
    if text[start] == "[":
        yield from _iter_array(p, text, start + 1, dec, rep)
        return
    try:
        obj, end = dec.raw_decode(text, start)
        whole = not text[end:].strip()
    except json.JSONDecodeError:
        obj, whole = None, False
    if whole and isinstance(obj, dict):
        rep.items = 1
        yield "object", obj
        return
    for lineno, line in enumerate(text.splitlines(), 1):  # JSON Lines
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        rep.items += 1
        yield f"line {lineno}", item


def _iter_array(p: Path, text: str, i: int, dec: json.JSONDecoder, rep: ReadReport) -> Iterator[tuple[str, Any]]:
    n, size = 0, len(text)
    while True:
        while i < size and text[i] in " \t\r\n,":
            i += 1
        if i >= size:
            if n == 0:
                raise WorkloadError(f"{p}: JSON array is not closed and holds no complete item")
            rep.truncated = True
            return
        if text[i] == "]":
            return
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if n > 0 and not text.rstrip().endswith("]"):
                rep.truncated = True  # cut-off file: keep what was complete
                return
            raise WorkloadError(f"{p}:{_line_of(text, e.pos)}: not valid JSON in item {n} ({e.msg})") from None
        n += 1
        rep.items = n
        yield f"item {n - 1}", item
