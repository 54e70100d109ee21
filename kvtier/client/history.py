"""Whose assistant messages a replayed prompt carries: the workload's text, or the model's own replies.

``workload`` (the replay's original behaviour): turn k is sent with the workload's assistant text
of turns 0..k-1 (``Conversation.chat_messages``), so every server configuration sees identical
prompts.

``live``: turn k is sent with the replies the model actually streamed for turns 0..k-1 of the same
conversation in the same run (``RequestRecord.reply``), with the workload's user messages, system
prompt and resumed-chat ``history`` (earlier messages never sent as requests), as a real chat
client does. Turn order, think times and interleaving are unchanged. A turn that failed has no
reply the user saw; its workload text is sent in its place and counted
(``RequestRecord.history_fallbacks``). Token-id turns (``prompt_token_ids``: a full prompt with the
replies already inside) cannot carry live replies: ``check_history`` refuses them with one line.

``sent_messages`` rebuilds the messages every recorded request carried from the records alone
(the replies are in them), which is what the live ideal hit rate (``kvtier.client.live_ideal``) is
computed from. Side-effect free.
"""

from __future__ import annotations

from typing import Iterable, Literal, Sequence

from kvtier.client.stream import Message, RequestRecord
from kvtier.workload.format import Conversation

HistoryMode = Literal["live", "workload"]
HISTORY_MODES: tuple[str, ...] = ("live", "workload")


class HistoryError(ValueError):
    """The workload cannot be replayed in the requested history mode (one line)."""


def check_history(mode: str, convs: Iterable[Conversation]) -> None:
    """Raise HistoryError for an unknown mode, or a live replay of token-id turns."""
    if mode not in HISTORY_MODES:
        raise HistoryError(f"unknown history mode {mode!r} (live or workload)")
    if mode != "live":
        return
    for c in convs:
        for k, t in enumerate(c.turns):
            if t.prompt_token_ids is not None:
                raise HistoryError(f"--history live needs text turns, but conversation {c.id!r} turn {k} is a "
                                   f"token-id prompt (its replies are fixed in the ids); use --history workload")


def live_messages(conv: Conversation, k: int, replies: Sequence[str | None]) -> tuple[list[Message], int]:
    """Chat messages of turn ``k`` with ``replies[j]`` as turn j's assistant message (j < k).

    A ``None`` reply (the turn failed) is replaced by the workload's assistant text. Returns the
    messages and how many replies were replaced."""
    if len(replies) < k:
        raise ValueError(f"turn {k} needs {k} earlier replies, got {len(replies)}")
    msgs: list[Message] = []
    if conv.system:
        msgs.append({"role": "system", "content": conv.system})
    msgs.extend({"role": h.role, "content": h.content} for h in conv.history)
    fallbacks = 0
    for j, t in enumerate(conv.turns[:k]):
        reply = replies[j]
        if reply is None:
            reply, fallbacks = t.assistant, fallbacks + 1
        msgs.append({"role": "user", "content": t.user or ""})
        msgs.append({"role": "assistant", "content": reply})
    msgs.append({"role": "user", "content": conv.turns[k].user or ""})
    return msgs, fallbacks


def live_reply(rec: RequestRecord) -> str | None:
    """What the next turn carries for this turn in live mode: the streamed text of a successful
    request ("" when it generated no text), None for a failed one."""
    return (rec.reply or "") if rec.ok else None


def sent_messages(convs: Sequence[Conversation], records: Sequence[RequestRecord]) -> list[tuple[RequestRecord, list[Message]]]:
    """(record, the chat messages it carried) for every chat record, in send order (``start_s``).

    Live records are rebuilt from the earlier records of their conversation (``live_reply``), so this
    holds exactly when the records are the whole run of those conversations; workload records use
    ``Conversation.chat_messages``. Token-id records are skipped."""
    by_id = {c.id: c for c in convs}
    by_turn = {(r.conversation_id, r.turn): r for r in records}
    out: list[tuple[RequestRecord, list[Message]]] = []
    for rec in sorted(records, key=lambda r: r.start_s):
        conv = by_id.get(rec.conversation_id)
        if conv is None or rec.api != "chat" or rec.turn >= len(conv.turns):
            continue
        if rec.history == "live":
            replies = []
            for j in range(rec.turn):
                prev = by_turn.get((rec.conversation_id, j))
                replies.append(live_reply(prev) if prev is not None else None)
            msgs, _ = live_messages(conv, rec.turn, replies)
        else:
            msgs = conv.chat_messages(rec.turn)
        out.append((rec, msgs))
    return out
