"""Workload JSONL format: round trip, chat history from the workload, clear errors."""

from __future__ import annotations

import pytest

from kvtier.workload.format import (Conversation, Turn, WorkloadError, WorkloadHeader, iter_conversations,
                                    load_workload, write_workload)


def _conv(i: int) -> Conversation:
    return Conversation(id=f"c{i}", system="be kind", metadata={"persona": "p"},
                        turns=[Turn(user="hi", assistant="hello"), Turn(user="how are you?", assistant="fine")])


def test_round_trip_and_history(tmp_path):
    p = tmp_path / "w.jsonl"
    assert write_workload(p, WorkloadHeader(name="t"), [_conv(0), _conv(1)]) == 2
    w = load_workload(p)
    assert w.header.name == "t" and w.num_requests == 4
    msgs = w.conversations[0].chat_messages(1)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == "hello"


def test_malformed_lines_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"kvtier_workload": 1}\n{"id": "a", "turns": [{"user": "x"}]}\n{not json\n'
                 '{"id": "b", "turns": []}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:3: not valid JSON"):
        list(iter_conversations(p))
    errors: list[str] = []
    ok = list(iter_conversations(p, skip_bad=True, errors=errors))
    assert [c.id for c in ok] == ["a"]
    assert len(errors) == 2 and errors[1].startswith(f"{p}:4: turns")


def test_turn_needs_exactly_one_prompt():
    with pytest.raises(ValueError):
        Turn()
    with pytest.raises(ValueError):
        Turn(user="x", prompt_token_ids=[1])


def test_missing_file():
    with pytest.raises(WorkloadError, match="not found"):
        load_workload("/nonexistent/w.jsonl")
