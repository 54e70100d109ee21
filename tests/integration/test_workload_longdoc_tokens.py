"""longdoc with the real model tokenizer: document lengths are exact in model tokens."""

from __future__ import annotations

import pytest

from kvtier.workload.longdoc import LongDocSpec, generate_longdoc
from kvtier.workload.tokens import HFTokenizer

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_longdoc_exact_token_lengths_with_real_tokenizer(bundled_model):
    tok = HFTokenizer.open(bundled_model)
    spec = LongDocSpec(documents=4, doc_tokens=1234, spread=0.0, questions=2, max_prompt_length=8000)
    _, convs = generate_longdoc(spec, tok)
    for c in convs:
        doc = c.turns[0].user.split("The paper begins.\n", 1)[1].rsplit("\nNow the paper ends.", 1)[0]
        assert len(tok.encode(doc)) == c.metadata["doc_tokens"] == 1234
        assert c.metadata["prompt_tokens"] == len(tok.render_chat(c.chat_messages(0))) <= 8000
    capped = generate_longdoc(LongDocSpec(documents=2, doc_tokens=9000, spread=0.0, max_prompt_length=4000), tok)[1]
    assert all(3800 < c.metadata["prompt_tokens"] <= 4000 for c in capped)
