"""Workload statistics and the ideal (infinite-cache) prefix hit rate.

Prompt of a request: a token-id turn's ``prompt_token_ids`` as given; a text turn's
``Conversation.chat_messages(k)`` rendered to token ids by the tokenizer (the model's own
chat template with an ``HFTokenizer``; the ChatML-like chars/4 approximation of
``ApproxTokenizer`` otherwise).

Ideal hit rate: requests are replayed in nominal send order (``Workload.request_order``:
arrival hints and think times, a conversation's turns in order). Each prompt is cut into
full blocks of ``block_size`` tokens, identified by a hash chain (block i's key covers
tokens [0, (i+1)*block_size)), like vLLM's prefix cache. A request hits the longest run of
leading blocks already seen; every full block of its prompt is then remembered (infinite
cache, prompts only: generated tokens differ from the workload's assistant text). The
rate is hit tokens / all prompt tokens (the partial last block always misses).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np
import xxhash

from kvtier.workload.format import Workload
from kvtier.workload.tokens import ApproxTokenizer, TokenCounter, render_chat_many

_BATCH = 64


@dataclass(frozen=True)
class Distribution:
    count: int
    min: float
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float] | list[int]) -> "Distribution":
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
        return cls(len(a), float(a.min()), float(a.mean()), p50, p90, p99, float(a.max()))


@dataclass(frozen=True)
class WorkloadStats:
    name: str
    conversations: int
    requests: int
    tokenizer: str
    block_size: int
    turns: Distribution
    turns_histogram: dict[int, int]
    prompt_tokens: Distribution
    total_prompt_tokens: int
    max_tokens: Distribution
    duration_s: float
    ideal_hit_tokens: int
    ideal_hit_rate: float
    metadata_counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def iter_request_prompts(workload: Workload, tokenizer: TokenCounter | None) -> Iterator[tuple[int, int, list[int]]]:
    """Yield (conversation index, turn index, prompt token ids) in nominal send order."""
    tok = tokenizer if tokenizer is not None else ApproxTokenizer()
    order = workload.request_order()
    for start in range(0, len(order), _BATCH):
        chunk = order[start:start + _BATCH]
        text_idx = [i for i, (ci, k) in enumerate(chunk) if workload.conversations[ci].turns[k].prompt_token_ids is None]
        rendered = render_chat_many(tok, [workload.conversations[chunk[i][0]].chat_messages(chunk[i][1])
                                          for i in text_idx])
        by_pos = dict(zip(text_idx, rendered))
        for i, (ci, k) in enumerate(chunk):
            ids = workload.conversations[ci].turns[k].prompt_token_ids
            yield ci, k, (ids if ids is not None else by_pos[i])


class PrefixBlockSet:
    """Infinite set of hash-chained full blocks: ``lookup_and_insert`` returns hit tokens."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block size must be >= 1")
        self.block_size = block_size
        self._seen: set[bytes] = set()

    def lookup_and_insert(self, token_ids: list[int]) -> int:
        bs = self.block_size
        arr = np.asarray(token_ids, dtype=np.int64)
        key = b""
        hit_blocks, matching = 0, True
        for b in range(len(arr) // bs):
            key = xxhash.xxh3_128_digest(key + arr[b * bs:(b + 1) * bs].tobytes())
            if matching and key in self._seen:
                hit_blocks += 1
            else:
                matching = False
                self._seen.add(key)
        return hit_blocks * bs


def ideal_hit_rate(workload: Workload, tokenizer: TokenCounter | None = None, block_size: int = 256) -> float:
    """Fraction of prompt tokens an infinite prefix cache would serve (see module docstring)."""
    return workload_stats(workload, tokenizer, block_size).ideal_hit_rate


def workload_stats(workload: Workload, tokenizer: TokenCounter | None = None, block_size: int = 256) -> WorkloadStats:
    blocks = PrefixBlockSet(block_size)
    lengths: list[int] = []
    hits = 0
    for _, _, ids in iter_request_prompts(workload, tokenizer):
        lengths.append(len(ids))
        hits += blocks.lookup_and_insert(ids)
    total = sum(lengths)
    turns = [len(c.turns) for c in workload.conversations]
    hist: dict[int, int] = {}
    for n in sorted(turns):
        hist[n] = hist.get(n, 0) + 1
    meta: dict[str, dict[str, int]] = {}
    for key in ("persona", "tone", "category", "doc"):
        counts: dict[str, int] = {}
        for c in workload.conversations:
            if key in c.metadata:
                v = str(c.metadata[key])
                counts[v] = counts.get(v, 0) + 1
        if counts:
            meta[key] = dict(sorted(counts.items()))
    duration = max((max(c.request_times()) for c in workload.conversations), default=0.0)
    return WorkloadStats(
        name=workload.header.name, conversations=len(workload.conversations), requests=len(lengths),
        tokenizer=(tokenizer.name if tokenizer is not None else ApproxTokenizer.name), block_size=block_size,
        turns=Distribution.of(turns), turns_histogram=hist, prompt_tokens=Distribution.of(lengths),
        total_prompt_tokens=total, max_tokens=Distribution.of([t.max_tokens for c in workload.conversations
                                                               for t in c.turns]),
        duration_s=float(duration), ideal_hit_tokens=hits, ideal_hit_rate=(hits / total if total else 0.0),
        metadata_counts=meta)
