"""The kvtier workload format (JSONL, versioned).

A workload file is JSON Lines. The first line is a header; every other line is one
conversation::

    {"kvtier_workload": 1, "name": "companion", "generator": {...}, "tokenizer": "...", "description": "..."}
    {"id": "c0001", "arrival_s": 0.0, "metadata": {"persona": "...", "tone": "...", "category": "..."},
     "system": "You are ...",                       # optional system prompt
     "turns": [
        {"user": "hi", "assistant": "hello!", "think_time_s": 3.0, "max_tokens": 32},
        {"user_token_ids": [1, 2, 3], "assistant": "...", ...}
     ]}

Turn k of a conversation is sent as the system prompt + the conversation's ``history``
(earlier messages of a resumed chat, optional) + all earlier turns' user and *workload*
assistant messages + turn k's user message, so every server configuration sees identical
prompts (``--history live`` replay sends the model's own replies instead:
``kvtier.client.history``). Conversations and turns may carry free-form ``metadata``. Full reference:
docs/workload-format.md. ``arrival_s`` is the conversation's arrival hint (open-loop
replay, trace timestamps); ``think_time_s`` is the pause after the previous turn
finished. A turn may carry token ids instead of text (``prompt_token_ids``: the full
prompt, for completions-API replay of traces such as Mooncake).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

WORKLOAD_FORMAT_VERSION = 1


class WorkloadError(ValueError):
    """Malformed workload input; the message names the file, line and problem."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Turn(_Model):
    user: str | None = None
    prompt_token_ids: list[int] | None = Field(
        default=None, description="full prompt as token ids (completions API); replaces chat history")
    assistant: str = ""
    think_time_s: float = Field(default=0.0, ge=0)
    max_tokens: int = Field(default=32, ge=1)
    arrival_s: float | None = Field(default=None, ge=0, description="absolute arrival hint (trace replay)")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form labels (category, tone, ...)")

    @model_validator(mode="after")
    def _one_prompt(self) -> "Turn":
        if (self.user is None) == (self.prompt_token_ids is None):
            raise ValueError("a turn needs exactly one of 'user' or 'prompt_token_ids'")
        return self


class HistoryMessage(_Model):
    role: Literal["user", "assistant"]
    content: str


class Conversation(_Model):
    id: str
    arrival_s: float = Field(default=0.0, ge=0)
    system: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    history: list[HistoryMessage] = Field(
        default_factory=list, description="earlier messages of a resumed chat: in every prompt, never sent as requests")
    turns: list[Turn] = Field(min_length=1)

    def chat_messages(self, k: int) -> list[dict[str, str]]:
        """OpenAI chat messages for turn ``k`` (0-based): history from the workload, not the model."""
        msgs: list[dict[str, str]] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        msgs.extend({"role": h.role, "content": h.content} for h in self.history)
        for t in self.turns[:k]:
            msgs.append({"role": "user", "content": t.user or ""})
            msgs.append({"role": "assistant", "content": t.assistant})
        msgs.append({"role": "user", "content": self.turns[k].user or ""})
        return msgs

    def request_times(self) -> list[float]:
        """Nominal send time of each turn, ignoring service time: a turn's own ``arrival_s``
        when given, else the previous turn's time (or the conversation's ``arrival_s``) plus
        its ``think_time_s``. Non-decreasing by construction."""
        times: list[float] = []
        t = self.arrival_s
        for k, turn in enumerate(self.turns):
            if turn.arrival_s is not None:
                t = max(t, turn.arrival_s)
            elif k > 0:
                t = t + turn.think_time_s
            times.append(t)
        return times


class WorkloadHeader(_Model):
    kvtier_workload: int = WORKLOAD_FORMAT_VERSION
    name: str = "workload"
    description: str = ""
    tokenizer: str | None = None
    generator: dict[str, Any] = Field(default_factory=dict)


class Workload(_Model):
    header: WorkloadHeader
    conversations: list[Conversation]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def request_order(self) -> list[tuple[int, int]]:
        """(conversation index, turn index) of every request in nominal send order: by
        ``Conversation.request_times()``, ties broken by file order; a conversation's turns
        always stay in order."""
        keyed = [(t, ci, k) for ci, c in enumerate(self.conversations) for k, t in enumerate(c.request_times())]
        keyed.sort()
        return [(ci, k) for _, ci, k in keyed]


def _short(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    return f"{loc}: {e['msg'].removeprefix('Value error, ')}" if loc else e["msg"]


def iter_conversations(path: str | Path, *, skip_bad: bool = False,
                       errors: list[str] | None = None) -> Iterator[Conversation]:
    """Yield conversations from a workload file. A bad line raises WorkloadError naming
    file and line, or, with ``skip_bad``, is appended to ``errors`` and skipped."""
    p = Path(path)
    try:
        fh = p.open("r", encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"workload file not found: {p}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if lineno == 1 and isinstance(obj, dict) and "kvtier_workload" in obj:
                    hdr = WorkloadHeader.model_validate(obj)
                    if hdr.kvtier_workload != WORKLOAD_FORMAT_VERSION:
                        raise WorkloadError(f"{p}:1: unsupported workload format version {hdr.kvtier_workload}")
                    continue
                yield Conversation.model_validate(obj)
            except (json.JSONDecodeError, ValidationError) as e:
                msg = f"{p}:{lineno}: " + (f"not valid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError)
                                           else _short(e))
                if not skip_bad:
                    raise WorkloadError(msg) from None
                if errors is not None:
                    errors.append(msg)


def read_header(path: str | Path) -> WorkloadHeader:
    p = Path(path)
    try:
        with p.open("r", encoding="utf-8") as fh:
            first = fh.readline()
    except FileNotFoundError:
        raise WorkloadError(f"workload file not found: {p}") from None
    try:
        obj = json.loads(first) if first.strip() else {}
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{p}:1: not valid JSON ({e.msg})") from None
    if isinstance(obj, dict) and "kvtier_workload" in obj:
        try:
            return WorkloadHeader.model_validate(obj)
        except ValidationError as e:
            raise WorkloadError(f"{p}:1: {_short(e)}") from None
    return WorkloadHeader()


def load_workload(path: str | Path, *, skip_bad: bool = False, errors: list[str] | None = None) -> Workload:
    return Workload(header=read_header(path),
                    conversations=list(iter_conversations(path, skip_bad=skip_bad, errors=errors)))


def write_workload(path: str | Path, header: WorkloadHeader, conversations: Iterable[Conversation]) -> int:
    """Write atomically (temp file + rename). Returns the number of conversations written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(header.model_dump_json() + "\n")
        for c in conversations:
            fh.write(c.model_dump_json(exclude_defaults=True) + "\n")
            n += 1
    tmp.replace(p)
    return n
