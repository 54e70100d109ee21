"""Tokenizer plumbing for workloads: one small protocol, two implementations.

``TokenCounter`` is what generators and ``stats`` need: ``encode`` (plain text, no special
tokens), ``decode`` and ``render_chat`` (the full chat prompt of a request, as token ids,
with the generation prompt appended).

* ``HFTokenizer`` wraps a Hugging Face tokenizer folder (``tokenizer.json``); chat prompts
  use the folder's own chat template (``apply_chat_template``), so counts are exact.
* ``ApproxTokenizer`` needs nothing: a deterministic stand-in where one token is four
  characters of text (``len(text)/4`` rounded up), ids are stable 31-bit hashes of those
  4-character pieces, and a chat prompt is ChatML-like: for each message
  ``<|im_start|>`` + ``role\n`` + content + ``<|im_end|>`` (markers one token each; role
  header and content encoded separately), then the generation prompt
  ``<|im_start|>assistant\n``. So a prompt that extends another's messages extends its
  token ids too, generation prompt included (prefix-stable, like real templates).

Tests pass their own object with the same three methods (a "fake tokenizer").
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import xxhash

Message = dict[str, str]


class TokenizerError(RuntimeError):
    """The requested tokenizer cannot be loaded; the message says why and what to do."""


@runtime_checkable
class TokenCounter(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: list[Message]) -> list[int]: ...


class ApproxTokenizer:
    """Deterministic ~chars/4 tokenizer (see module docstring). No decode of real meaning:
    ``decode`` maps ids back only for ids it produced in this process."""

    name = "approx-chars/4"
    CHARS_PER_TOKEN = 4
    _SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}

    def _piece_id(self, piece: str) -> int:
        tid = (xxhash.xxh32_intdigest(piece.encode("utf-8")) & 0x7FFFFFFF) | 0x100
        self._pieces.setdefault(tid, piece)
        return tid

    def encode(self, text: str) -> list[int]:
        n = self.CHARS_PER_TOKEN
        return [self._piece_id(text[i:i + n]) for i in range(0, len(text), n)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces.get(i, "") for i in ids)

    @classmethod
    def message_length(cls, role: str, content: str) -> int:
        """Tokens one message adds to ``render_chat``: 2 markers + role header + content."""
        n = cls.CHARS_PER_TOKEN
        return 2 + -(-(len(role) + 1) // n) + -(-len(content) // n)

    GENERATION_PROMPT_LENGTH = 1 + -(-len("assistant\n") // CHARS_PER_TOKEN)

    def render_chat(self, messages: list[Message]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out.append(self._SPECIAL["<|im_start|>"])
            out.extend(self.encode(m["role"] + "\n"))
            out.extend(self.encode(m["content"]))
            out.append(self._SPECIAL["<|im_end|>"])
        out.append(self._SPECIAL["<|im_start|>"])
        out.extend(self.encode("assistant\n"))
        return out


def approx_token_count(text: str) -> int:
    """The documented approximation: ceil(len(text) / 4)."""
    return -(-len(text) // ApproxTokenizer.CHARS_PER_TOKEN)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a model folder. Use ``HFTokenizer.open(path)``."""

    def __init__(self, tokenizer: object, name: str) -> None:
        self._tok = tokenizer
        self.name = name

    @classmethod
    def open(cls, path: str | Path) -> "HFTokenizer":
        p = Path(path).expanduser()
        if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {p} (pass --tokenizer PATH to a Hugging Face model folder)")
        try:
            from transformers import AutoTokenizer  # lazy: heavy import
        except ImportError:
            raise TokenizerError("the 'transformers' package is not installed (pip install 'kvtier[vllm]')") from None
        try:
            tok = AutoTokenizer.from_pretrained(str(p))
        except Exception as e:  # noqa: BLE001 - any load failure is one clear line
            raise TokenizerError(f"cannot load tokenizer from {p}: {type(e).__name__}: {e}") from None
        return cls(tok, str(p))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: list[Message]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def render_chat_batch(self, batch: list[list[Message]]) -> list[list[int]]:
        if not batch:  # the HF fast tokenizer raises IndexError on an empty list
            return []
        texts = [self._tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
        return [list(x) for x in self._tok(texts, add_special_tokens=False)["input_ids"]]


def default_tokenizer_path() -> Path:
    """kvtier's default model folder (kvtier.model.default_model_path())."""
    try:
        from kvtier.model import default_model_path
    except ImportError:
        raise TokenizerError("no default model folder (kvtier.model is missing); pass --tokenizer PATH") from None
    return Path(default_model_path())


def load_tokenizer(path: str | Path | None) -> HFTokenizer:
    """Load the HF tokenizer at ``path``, or the default model folder's when None."""
    p = Path(path) if path is not None else default_tokenizer_path()
    if not p.exists():
        hint = "" if path is not None else " (run `kvtier doctor` to prepare the default model)"
        raise TokenizerError(f"tokenizer folder not found: {p}{hint}")
    return HFTokenizer.open(p)


def render_chat_many(tokenizer: TokenCounter, batch: list[list[Message]]) -> list[list[int]]:
    """Render many chat prompts, batched when the tokenizer supports it. An empty batch
    (e.g. a slice of a token-id workload: nothing to render) gives an empty list."""
    if not batch:
        return []
    fn = getattr(tokenizer, "render_chat_batch", None)
    if fn is not None:
        return fn(batch)
    return [tokenizer.render_chat(m) for m in batch]
