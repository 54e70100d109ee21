"""The approximate tokenizer, memoised, for tests whose sizing searches generate hundreds of workloads.

``MemoApproxTokenizer`` gives exactly ``ApproxTokenizer``'s ids: it encodes each distinct text once
(``Encoded``, shared by the instances that get the same one) and, with ``render_once``, renders each
chat prompt once per instance. Seeded companion workloads repeat the same messages across sizes and
turns, and a workload's facts may read its prompts several times; hashing their 4-character pieces
again was most of these tests' time. ``decode`` maps back every id of the shared ``Encoded`` (the
first piece seen wins a hash collision, as within one ``ApproxTokenizer``). ``render_once`` holds
every rendered prompt until the instance goes: one such instance per workload; one ``Encoded`` per
test module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.workload.tokens import ApproxTokenizer, Message


@dataclass
class Encoded:
    """Texts already encoded and the pieces behind their ids."""

    ids: dict[str, list[int]] = field(default_factory=dict)
    pieces: dict[int, str] = field(default_factory=dict)


class MemoApproxTokenizer(ApproxTokenizer):
    def __init__(self, encoded: Encoded, render_once: bool = False) -> None:
        super().__init__()
        self._encoded = encoded.ids
        self._pieces = encoded.pieces
        self._rendered: dict[tuple[tuple[str, str], ...], list[int]] | None = {} if render_once else None

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = super().encode(text)
        return list(ids)

    def render_chat(self, messages: list[Message]) -> list[int]:
        if self._rendered is None:
            return super().render_chat(messages)
        key = tuple((m["role"], m["content"]) for m in messages)
        ids = self._rendered.get(key)
        if ids is None:
            ids = self._rendered[key] = super().render_chat(messages)
        return list(ids)
