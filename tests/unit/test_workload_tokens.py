"""Tokenizer plumbing: the chars/4 approximation and clear load errors."""

from __future__ import annotations

import pytest

from kvtier.workload.format import Conversation, HistoryMessage, Turn
from kvtier.workload.tokens import ApproxTokenizer, HFTokenizer, TokenizerError, approx_token_count, load_tokenizer


def test_approx_counts_and_prefix_stability():
    tok = ApproxTokenizer()
    assert approx_token_count("") == 0 and approx_token_count("abcde") == 2
    assert len(tok.encode("abcdefgh")) == 2 and tok.decode(tok.encode("abcdefgh")) == "abcdefgh"
    conv = Conversation(id="c", system="sys prompt", history=[HistoryMessage(role="user", content="old"),
                                                              HistoryMessage(role="assistant", content="older")],
                        turns=[Turn(user="hello", assistant="hi there"), Turn(user="more")])
    p0, p1 = tok.render_chat(conv.chat_messages(0)), tok.render_chat(conv.chat_messages(1))
    assert p1[: len(p0)] == p0  # a later turn extends the earlier prompt
    msgs = conv.chat_messages(1)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    expected = sum(ApproxTokenizer.message_length(m["role"], m["content"]) for m in msgs)
    assert len(p1) == expected + ApproxTokenizer.GENERATION_PROMPT_LENGTH


def test_missing_tokenizer_folder_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer folder not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        HFTokenizer.open(tmp_path)
