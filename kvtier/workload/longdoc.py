"""Long-document QA workload (LongAlpaca-style), sized in the target model's tokens.

Each document is a synthetic research paper cut to an exact token count of the given
tokenizer (``doc_tokens`` median; lengths uniform in ``doc_tokens * (1 +- spread)``,
capped so the full chat prompt fits ``max_prompt_length`` tokens). Each request is one
single-turn conversation: the LongAlpaca prompt (document first, then the question) as
one user message, after an optional system prompt. Every document gets ``questions``
questions, and documents are revisited interleaved in groups of ``interleave``
(doc A q1, doc B q1, ..., doc A q2, ...), so a cache must keep a document between its
visits. Arrivals are Poisson at ``rate`` requests/s.

Metadata per request: ``doc`` (id), ``doc_tokens`` (exact count of the document text,
``tokenizer.encode``), ``question`` (index), ``prompt_tokens`` (the full rendered prompt).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from kvtier.workload.format import Conversation, Turn, WorkloadHeader
from kvtier.workload.longdoc_text import LONGALPACA_PROMPT, QUESTIONS, PaperFacts
from kvtier.workload.tokens import TokenCounter


@dataclass(frozen=True)
class LongDocSpec:
    documents: int = 8
    doc_tokens: int = 3000
    spread: float = 0.5
    max_prompt_length: int = 7000
    questions: int = 4
    interleave: int = 4
    max_tokens: int = 128
    system: str | None = None
    rate: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        checks = [
            (self.documents >= 1, "documents must be >= 1"),
            (self.doc_tokens >= 16, "doc-tokens must be >= 16"),
            (0.0 <= self.spread < 1.0, "spread must be in [0, 1)"),
            (self.max_prompt_length >= 128, "max-prompt-length must be >= 128"),
            (1 <= self.questions <= len(QUESTIONS), f"questions must be in [1, {len(QUESTIONS)}]"),
            (self.interleave >= 1, "interleave must be >= 1"),
            (self.max_tokens >= 1, "max-tokens must be >= 1"),
            (self.rate > 0, "rate must be > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def fit_to_tokens(tokenizer: TokenCounter, paragraphs, target: int) -> tuple[str, int]:
    """Text from ``paragraphs`` whose ``tokenizer.encode`` length is exactly ``target`` when
    a cut achieves it (else the closest below). Returns (text, exact token count)."""
    text, n = "", 0
    for para in paragraphs:
        text += para
        if len(text) // 2 >= target:  # cheap pre-check (subword tokens average > 2 chars), then exact
            n = len(tokenizer.encode(text))
            if n >= target:
                break
    ids = tokenizer.encode(text)
    best: tuple[str, int] | None = None
    for delta in (0, -1, 1, -2, 2, -3, 3, -4, 4, -6, -8, -12, -16):
        cut = min(len(ids), max(1, target + delta))
        cand = tokenizer.decode(ids[:cut])
        m = len(tokenizer.encode(cand))
        if m == target:
            return cand, m
        if m < target and (best is None or m > best[1]):
            best = (cand, m)
    if best is None:
        raise ValueError(f"cannot cut a document to {target} tokens")
    return best


def _messages(spec: LongDocSpec, doc: str, question: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": spec.system}] if spec.system else []
    msgs.append({"role": "user", "content": LONGALPACA_PROMPT.format(doc=doc, question=question)})
    return msgs


def generate_longdoc(spec: LongDocSpec, tokenizer: TokenCounter) -> tuple[WorkloadHeader, list[Conversation]]:
    spec.validate()
    rng = random.Random(spec.seed)
    docs: list[tuple[str, int, list[str]]] = []
    for d in range(spec.documents):
        facts = PaperFacts(rng)
        questions = [facts.fill(q) for q in rng.sample(QUESTIONS, spec.questions)]
        overhead = max(len(tokenizer.render_chat(_messages(spec, "", q))) for q in questions)
        cap = spec.max_prompt_length - overhead - 8
        if cap < 16:
            raise ValueError(f"max-prompt-length {spec.max_prompt_length} leaves no room for a document")
        lo, hi = spec.doc_tokens * (1 - spec.spread), spec.doc_tokens * (1 + spec.spread)
        target = min(cap, max(16, int(rng.uniform(lo, hi))))
        text, n = fit_to_tokens(tokenizer, facts.paragraphs(), target)
        docs.append((text, n, questions))
    order = []
    for g in range(0, spec.documents, spec.interleave):
        group = range(g, min(spec.documents, g + spec.interleave))
        order += [(d, q) for q in range(spec.questions) for d in group]
    conversations: list[Conversation] = []
    t = 0.0
    for i, (d, q) in enumerate(order):
        t += rng.expovariate(spec.rate) if i else 0.0
        text, n, questions = docs[d]
        msgs = _messages(spec, text, questions[q])
        prompt_tokens = len(tokenizer.render_chat(msgs))
        if prompt_tokens > spec.max_prompt_length:
            raise ValueError(f"doc d{d:03d} question {q}: prompt has {prompt_tokens} tokens "
                             f"> max-prompt-length {spec.max_prompt_length}")
        conversations.append(Conversation(
            id=f"d{d:03d}-q{q}", arrival_s=round(t, 3), system=spec.system,
            metadata={"doc": f"d{d:03d}", "doc_tokens": n, "question": q, "prompt_tokens": prompt_tokens,
                      "category": "longdoc_qa"},
            turns=[Turn(user=msgs[-1]["content"], max_tokens=spec.max_tokens)]))
    header = WorkloadHeader(name="longdoc", tokenizer=tokenizer.name,
                            description="long-document QA (LongAlpaca-style), documents revisited interleaved",
                            generator={"kind": "longdoc", **asdict(spec)})
    return header, conversations
