"""Chat-dataset importer: ShareGPT JSON and vLLM's multi-turn benchmark JSON.

Accepted item shapes (liberal in what we accept):

* ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``
* vLLM ``benchmarks/multi_turn``: ``{"id": ..., "messages": [{"role": "user"|"assistant"|"system",
  "content": ...}]}``, or a mapping ``{conversation id: [messages]}``
* either as a JSON array, a JSON object, or JSON Lines; role keys ``from``/``role``, text
  keys ``value``/``content``/``text``; roles human/user, gpt/chatgpt/bard/bing/assistant/model,
  system.

Messages become turns: leading assistant messages are dropped, consecutive messages of
one role are merged, each user message pairs with the following assistant message (a
trailing user message gets an empty reply). ShareGPT splits long chats into parts with ids
``X_0``, ``X_1``...; adjacent parts are merged back (``merge_parts``, default on for ShareGPT only).
Arrivals: Poisson at ``rate`` conversations/s; think times exponential with mean
``think_time_s`` (seeded). ``max_tokens`` = the reply's approx tokens (chars/4), clipped.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvtier.workload.format import Conversation, Turn, WorkloadError, WorkloadHeader
from kvtier.workload.importers.jsonread import ReadReport, iter_json_items
from kvtier.workload.tokens import ApproxTokenizer, approx_token_count

_USER = {"human", "user", "prompter"}
_ASSISTANT = {"gpt", "chatgpt", "bard", "bing", "assistant", "model", "bot"}


@dataclass(frozen=True)
class ChatImportOptions:
    max_conversations: int | None = None
    min_turns: int = 1
    max_turns: int | None = None
    max_prompt_tokens: int | None = None  # approx chars/4; later turns are cut
    max_output_tokens: int = 512
    rate: float = 1.0
    think_time_s: float = 5.0
    merge_parts: bool | None = None  # None: True for ShareGPT (ids X_0, X_1...), else False
    seed: int = 0


def _messages(p: Path, label: str, item: Any) -> tuple[str | None, list[tuple[str, str]]]:
    if isinstance(item, tuple):  # (id, messages) from a mapping
        cid, msgs = item
    elif isinstance(item, dict):
        cid = item.get("id", item.get("conversation_id"))
        msgs = next((item[k] for k in ("conversations", "messages", "conversation") if k in item), None)
        if msgs is None:
            raise WorkloadError(f"{p}: {label}: expected a 'conversations' or 'messages' list")
    else:
        raise WorkloadError(f"{p}: {label}: expected a conversation object, got {type(item).__name__}")
    if not isinstance(msgs, list):
        raise WorkloadError(f"{p}: {label}: messages must be a list, got {type(msgs).__name__}")
    out: list[tuple[str, str]] = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise WorkloadError(f"{p}: {label}: message {j} is not an object")
        role = str(m.get("from", m.get("role", ""))).lower()
        text = next((m[k] for k in ("value", "content", "text") if k in m), None)
        if not isinstance(text, str):
            raise WorkloadError(f"{p}: {label}: message {j} has no text ('value' or 'content')")
        if role in _USER:
            out.append(("user", text))
        elif role in _ASSISTANT:
            out.append(("assistant", text))
        elif role == "system":
            out.append(("system", text))
        else:
            raise WorkloadError(f"{p}: {label}: message {j} has unknown role {role!r}")
    return (None if cid is None else str(cid)), out


def _conversation_items(path: Path, report: ReadReport) -> Iterator[tuple[str | None, list[tuple[str, str]]]]:
    for label, item in iter_json_items(path, report):
        if label == "object" and isinstance(item, dict) and not any(
                k in item for k in ("conversations", "messages", "conversation")):
            for k, v in item.items():  # mapping id -> messages
                yield _messages(path, f"key {k!r}", (k, v))
        else:
            yield _messages(path, label, item)


def _merged(items: Iterator[tuple[str | None, list[tuple[str, str]]]], merge: bool
            ) -> Iterator[tuple[str | None, list[tuple[str, str]]]]:
    cur_base, cur_id, cur = None, None, []
    for cid, msgs in items:
        base = cid.rsplit("_", 1)[0] if (merge and cid and "_" in cid and cid.rsplit("_", 1)[1].isdigit()) else None
        if base is not None and base == cur_base:
            cur.extend(msgs)
            continue
        if cur or cur_id is not None:
            yield cur_id, cur
        cur_base, cur_id, cur = base, (base if base is not None else cid), list(msgs)
    if cur or cur_id is not None:
        yield cur_id, cur


def conversation_from_messages(cid: str, msgs: list[tuple[str, str]], opts: ChatImportOptions,
                               rng: random.Random, arrival_s: float) -> Conversation | None:
    """Turn normalized (role, text) messages into a Conversation; None if under min_turns."""
    system = "\n\n".join(t for r, t in msgs if r == "system") or None
    merged: list[list[str]] = []
    for role, text in msgs:
        if role == "system" or (not merged and role == "assistant"):
            continue
        if merged and merged[-1][0] == role:
            merged[-1][1] += "\n\n" + text
        else:
            merged.append([role, text])
    turns: list[Turn] = []
    approx = ApproxTokenizer()
    conv = Conversation(id=cid, arrival_s=round(arrival_s, 3), system=system, turns=[Turn(user="")])
    for i in range(0, len(merged), 2):
        if opts.max_turns is not None and len(turns) >= opts.max_turns:
            break
        reply = merged[i + 1][1] if i + 1 < len(merged) else ""
        turn = Turn(user=merged[i][1], assistant=reply,
                    think_time_s=round(rng.expovariate(1.0 / opts.think_time_s), 3) if turns and opts.think_time_s > 0
                    else 0.0,
                    max_tokens=max(1, min(opts.max_output_tokens, approx_token_count(reply) or 128)))
        conv.turns = turns + [turn]
        if opts.max_prompt_tokens is not None and \
                len(approx.render_chat(conv.chat_messages(len(turns)))) > opts.max_prompt_tokens:
            break
        turns.append(turn)
    if len(turns) < max(1, opts.min_turns):
        return None
    conv.turns = turns
    return conv


def import_chat_file(path: str | Path, opts: ChatImportOptions, kind: str
                     ) -> tuple[WorkloadHeader, list[Conversation], ReadReport]:
    """Import a ShareGPT / vLLM multi-turn file. ``kind`` names the format in the header."""
    p = Path(path)
    rng = random.Random(opts.seed)
    report = ReadReport()
    out: list[Conversation] = []
    t = 0.0
    merge = opts.merge_parts if opts.merge_parts is not None else kind == "sharegpt"
    for n, (cid, msgs) in enumerate(_merged(_conversation_items(p, report), merge)):
        if opts.max_conversations is not None and len(out) >= opts.max_conversations:
            break
        arrival = t + (rng.expovariate(opts.rate) if out else 0.0)
        conv = conversation_from_messages(cid or f"conv{n:06d}", msgs, opts, rng, arrival)
        if conv is not None:
            conv.metadata = {"source": kind, "category": kind}
            out.append(conv)
            t = arrival
    if report.truncated:
        print(f"warning: {p} is truncated; kept the {report.items} complete items before the cut", file=sys.stderr)
    if not out:
        raise WorkloadError(f"{p}: no conversation with at least {max(1, opts.min_turns)} turn(s) found")
    header = WorkloadHeader(name=kind, description=f"imported from {p.name}",
                            generator={"kind": f"import-{kind}", "source": str(p), **opts.__dict__})
    return header, out, report
