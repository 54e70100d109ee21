"""Test helpers for workload tests: a word-level fake tokenizer with exact round trips."""

from __future__ import annotations

import re
from typing import Sequence

_PIECE = re.compile(r"\s*\S+|\s+")


class WordTokenizer:
    """One token per whitespace-prefixed word; decode(encode(t)) == t. Chat prompt:
    [1] + role + content + [2] per message, then [1] + "assistant"."""

    name = "fake-words"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def _id(self, piece: str) -> int:
        if piece not in self._ids:
            self._ids[piece] = len(self._pieces) + 10
            self._pieces.append(piece)
        return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        return [self._id(p) for p in _PIECE.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces[i - 10] for i in ids)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += [1, *self.encode(m["role"]), *self.encode(m["content"]), 2]
        return out + [1, *self.encode("assistant")]
