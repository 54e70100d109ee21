"""Mooncake (FAST'25) trace importer.

Trace line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``, one hash id per 512-token block; equal leading ids mean a shared
prefix. Each request becomes a one-turn conversation whose ``prompt_token_ids`` are the
concatenated blocks of its hash ids: block ``h`` is ``block_tokens`` ids drawn from
``numpy.random.default_rng([salt, h])`` in ``[vocab_min, vocab_max)`` — the same id always
gives the same block, so shared hash-id prefixes give shared token prefixes. The prompt is
cut to the input length (the last block is partial).

``scale`` shrinks the trace for small-context models: block size and input length are
divided by it (``block_tokens = block_size // scale``, ``input = ceil(input_length / scale)``),
keeping the block structure; ``max_prompt_tokens`` then cuts (or, with ``drop_long``,
drops) longer prompts. ``output_length`` becomes ``max_tokens`` (clipped to
``max_output_tokens`` when set). Arrival = timestamp / 1000 * ``time_scale`` seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.workload.format import Conversation, Turn, WorkloadError, WorkloadHeader


@dataclass(frozen=True)
class MooncakeOptions:
    block_size: int = 512
    scale: int = 1
    max_prompt_tokens: int | None = None
    drop_long: bool = False
    max_output_tokens: int | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    vocab_min: int = 1000
    vocab_max: int = 49000
    salt: int = 0

    def validate(self) -> None:
        if self.block_size < 1 or self.scale < 1 or self.block_size // self.scale < 1:
            raise ValueError("block-size and scale must be >= 1 with block-size // scale >= 1")
        if not 0 <= self.vocab_min < self.vocab_max:
            raise ValueError("need 0 <= vocab-min < vocab-max")
        if self.time_scale < 0:
            raise ValueError("time-scale must be >= 0")


class BlockTokens:
    """hash id -> its deterministic block of token ids (memoized)."""

    def __init__(self, opts: MooncakeOptions) -> None:
        self.n = opts.block_size // opts.scale
        self._lo, self._hi, self._salt = opts.vocab_min, opts.vocab_max, opts.salt
        self._cache: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        block = self._cache.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self._salt, hash_id])
            block = rng.integers(self._lo, self._hi, size=self.n).tolist()
            self._cache[hash_id] = block
        return block


def _field(p: Path, lineno: int, rec: dict, key: str) -> int:
    v = rec.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise WorkloadError(f"{p}:{lineno}: '{key}' must be a non-negative integer, got {v!r}")
    return v


def import_mooncake(path: str | Path, opts: MooncakeOptions) -> tuple[WorkloadHeader, list[Conversation], int]:
    """Returns (header, conversations, number of requests cut or dropped by max_prompt_tokens)."""
    opts.validate()
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise WorkloadError(f"input file not found: {p}") from None
    blocks = BlockTokens(opts)
    out: list[Conversation] = []
    limited = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if opts.max_requests is not None and len(out) >= opts.max_requests:
            break
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise WorkloadError(f"{p}:{lineno}: expected a JSON object")
        ts = rec.get("timestamp")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            raise WorkloadError(f"{p}:{lineno}: 'timestamp' must be a non-negative number (ms), got {ts!r}")
        in_len, out_len = _field(p, lineno, rec, "input_length"), _field(p, lineno, rec, "output_length")
        hash_ids = rec.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                     for h in hash_ids):
            raise WorkloadError(f"{p}:{lineno}: 'hash_ids' must be a list of integers")
        n_tokens = -(-in_len // opts.scale)
        if len(hash_ids) * blocks.n < n_tokens:
            raise WorkloadError(f"{p}:{lineno}: {len(hash_ids)} hash ids cover fewer than input_length tokens")
        if opts.max_prompt_tokens is not None and n_tokens > opts.max_prompt_tokens:
            limited += 1
            if opts.drop_long:
                continue
            n_tokens = opts.max_prompt_tokens
        ids: list[int] = []
        for h in hash_ids[:-(-n_tokens // blocks.n)]:
            ids.extend(blocks(h))
        del ids[n_tokens:]
        if not ids:
            continue
        t = round(ts / 1000.0 * opts.time_scale, 6)
        max_tokens = max(1, out_len if opts.max_output_tokens is None else min(out_len, opts.max_output_tokens))
        out.append(Conversation(id=f"r{lineno - 1:06d}", arrival_s=t,
                                metadata={"source": "mooncake", "input_length": in_len, "hash_ids": hash_ids},
                                turns=[Turn(prompt_token_ids=ids, max_tokens=max_tokens, arrival_s=t)]))
    if not out:
        raise WorkloadError(f"{p}: no requests imported")
    header = WorkloadHeader(name="mooncake", description=f"Mooncake trace {p.name}, block tokens {blocks.n}",
                            generator={"kind": "import-mooncake", "source": str(p), **opts.__dict__})
    return header, out, limited
