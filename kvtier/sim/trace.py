"""A workload as the simulator sees it: arrays of requests and their prefix hashes.

``SimTrace`` holds requests grouped by conversation (turn order), each with its prompt
length, output length, think time, arrival hint and the hashes of its full prompt units
(``unit_tokens`` tokens each; ``kvtier.sim.hashing``). Sources:

* any kvtier workload file (``kvtier.workload.format``: generated companion / longdoc,
  imported ShareGPT, vLLM multi-turn, Mooncake with token ids): prompts are rendered
  exactly like ``kvtier workload stats`` does (``iter_request_prompts``: the HF tokenizer's
  chat template, or the chars/4 approximation), units = the engine's block size;
* a raw Mooncake trace (lines with ``hash_ids``, ``input_length``, ``output_length``,
  ``timestamp`` in ms): one unit per hash id (``block_size // scale`` tokens), so a
  1M-request trace never materialises token ids.

Building a trace is side-effect free (reads the file only).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.sim.hashing import prefix_hashes
from kvtier.sim.nogc import gc_paused
from kvtier.workload.format import WorkloadError, load_workload
from kvtier.workload.stats import iter_request_prompts
from kvtier.workload.tokens import ApproxTokenizer, TokenCounter


class _MemoApprox(ApproxTokenizer):
    """The chars/4 approximation, encoding each distinct message once: every turn of a
    conversation re-renders its whole history, so plain encoding is quadratic in turns.
    Same ids as ``ApproxTokenizer`` (encode is a pure function of the text)."""

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._memo.get(text)
        if ids is None:
            ids = self._memo[text] = super().encode(text)
        return ids


try:
    import msgspec as _msgspec

    class _MooncakeRecord(_msgspec.Struct):
        """One raw Mooncake trace line (other fields are ignored)."""
        timestamp: float
        input_length: int
        output_length: int
        hash_ids: list[int]
except ImportError:          # the checked line-by-line reader alone
    pass


@dataclass(frozen=True)
class SimTrace:
    name: str
    unit_tokens: int
    conv_ids: list[str]
    conv_arrival_s: np.ndarray      # float64 per conversation
    conv_offsets: np.ndarray        # int64, n_conv+1: requests of conversation c are [o[c], o[c+1])
    turn: np.ndarray                # int32 per request
    prompt_tokens: np.ndarray       # int64
    max_tokens: np.ndarray          # int64 (output tokens decoded, ignore_eos)
    think_s: np.ndarray             # float64 pause after the previous turn
    arrival_hint_s: np.ndarray      # float64, NaN when the turn has none
    hashes: np.ndarray              # uint64 unit hashes, all requests concatenated
    hoffsets: np.ndarray            # int64, n_req+1

    @property
    def num_requests(self) -> int:
        return len(self.turn)

    @property
    def num_conversations(self) -> int:
        return len(self.conv_ids)

    def units(self, r: int) -> np.ndarray:
        return self.hashes[self.hoffsets[r]:self.hoffsets[r + 1]]

    def subset(self, convs: np.ndarray) -> "SimTrace":
        """The trace of conversations ``convs`` only (in that order)."""
        convs = np.asarray(convs, dtype=np.int64)
        reqs = np.concatenate([np.arange(self.conv_offsets[c], self.conv_offsets[c + 1]) for c in convs]) \
            if len(convs) else np.zeros(0, dtype=np.int64)
        coff = np.zeros(len(convs) + 1, dtype=np.int64)
        np.cumsum(np.diff(self.conv_offsets)[convs], out=coff[1:])
        segs = [self.hashes[self.hoffsets[r]:self.hoffsets[r + 1]] for r in reqs]
        hoff = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in segs], out=hoff[1:])
        return SimTrace(self.name, self.unit_tokens, [self.conv_ids[c] for c in convs], self.conv_arrival_s[convs],
                        coff, self.turn[reqs], self.prompt_tokens[reqs], self.max_tokens[reqs], self.think_s[reqs],
                        self.arrival_hint_s[reqs], np.concatenate(segs) if segs else self.hashes[:0], hoff)

    def nominal_order(self) -> np.ndarray:
        """Request indices in nominal send order (arrival hints + think times; ties by file
        order), like ``Workload.request_order``."""
        t = np.empty(self.num_requests)
        for c in range(self.num_conversations):
            lo, hi = self.conv_offsets[c], self.conv_offsets[c + 1]
            now = self.conv_arrival_s[c]
            for r in range(lo, hi):
                hint = self.arrival_hint_s[r]
                if not np.isnan(hint):
                    now = max(now, hint)
                elif r > lo:
                    now += self.think_s[r]
                t[r] = now
        return np.lexsort((np.arange(self.num_requests), t))


def _is_raw_mooncake(path: Path) -> bool:
    try:
        with path.open("r", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and "hash_ids" in obj and "kvtier_workload" not in obj
    except FileNotFoundError:
        raise WorkloadError(f"workload file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}:1: not valid JSON ({getattr(e, 'msg', e)})") from None
    return False


def load_trace(path: str | Path, *, unit_tokens: int, tokenizer: TokenCounter | None = None,
               mooncake_block: int = 512, mooncake_scale: int = 1, time_scale: float = 1.0,
               max_requests: int | None = None) -> SimTrace:
    """Read a workload file or a raw Mooncake trace (auto-detected). WorkloadError on bad input."""
    p = Path(path)
    if p.is_dir():
        raise WorkloadError(f"workload path is a directory, not a file: {p}")
    if _is_raw_mooncake(p):
        return load_mooncake_raw(p, block=mooncake_block, scale=mooncake_scale, time_scale=time_scale,
                                 max_requests=max_requests)
    return load_workload_trace(p, unit_tokens=unit_tokens, tokenizer=tokenizer, max_requests=max_requests)


def load_workload_trace(path: Path, *, unit_tokens: int, tokenizer: TokenCounter | None,
                        max_requests: int | None = None) -> SimTrace:
    wl = load_workload(path)
    if not wl.conversations:
        raise WorkloadError(f"{path}: no conversations")
    convs = wl.conversations
    if max_requests is not None:     # keep whole conversations until the budget is used
        kept, n = [], 0
        for c in convs:
            if n >= max_requests:
                break
            kept.append(c)
            n += len(c.turns)
        wl = wl.model_copy(update={"conversations": kept})
        convs = kept
    prompts: dict[tuple[int, int], list[int]] = {}
    for ci, k, ids in iter_request_prompts(wl, tokenizer if tokenizer is not None else _MemoApprox()):
        prompts[(ci, k)] = ids
    offs = np.zeros(len(convs) + 1, dtype=np.int64)
    np.cumsum([len(c.turns) for c in convs], out=offs[1:])
    order = [(ci, k) for ci, c in enumerate(convs) for k in range(len(c.turns))]
    lists = [prompts[x] for x in order]
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    toff = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=toff[1:])
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(toff[-1]))
    hashes, hoffs = prefix_hashes(values, toff, unit_tokens)
    turns = [convs[ci].turns[k] for ci, k in order]
    return SimTrace(
        name=wl.header.name, unit_tokens=unit_tokens, conv_ids=[c.id for c in convs],
        conv_arrival_s=np.array([c.arrival_s for c in convs], dtype=np.float64), conv_offsets=offs,
        turn=np.array([k for _, k in order], dtype=np.int32), prompt_tokens=lengths,
        max_tokens=np.array([t.max_tokens for t in turns], dtype=np.int64),
        think_s=np.array([t.think_time_s for t in turns], dtype=np.float64),
        arrival_hint_s=np.array([np.nan if t.arrival_s is None else t.arrival_s for t in turns], dtype=np.float64),
        hashes=hashes, hoffsets=hoffs)


def load_mooncake_raw(path: Path, *, block: int = 512, scale: int = 1, time_scale: float = 1.0,
                      max_requests: int | None = None) -> SimTrace:
    """One single-turn conversation per trace line; units are hash ids (block // scale tokens)."""
    if block < 1 or scale < 1 or block // scale < 1:
        raise WorkloadError("mooncake block size and scale must be >= 1 with block // scale >= 1")
    unit = block // scale
    with gc_paused():                      # a record and a list per line: kvtier.sim.nogc
        fast = _mooncake_columns(path, scale, unit, max_requests)
        if fast is not None:
            ts, ins, outs, values, hoff = fast
        else:
            ts, ins, outs, values, hoff = _mooncake_columns_checked(path, scale, unit, max_requests)
    n = len(ts)
    hashes, _ = prefix_hashes(values, hoff, 1)
    arr = np.asarray(ts, dtype=np.float64) / 1000.0 * time_scale
    order = np.argsort(arr, kind="stable")
    return SimTrace(
        name=path.stem, unit_tokens=unit, conv_ids=[f"r{i:06d}" for i in range(n)],
        conv_arrival_s=arr, conv_offsets=np.arange(n + 1, dtype=np.int64),
        turn=np.zeros(n, dtype=np.int32), prompt_tokens=np.asarray(ins, dtype=np.int64),
        max_tokens=np.asarray(outs, dtype=np.int64), think_s=np.zeros(n), arrival_hint_s=arr.copy(),
        hashes=hashes, hoffsets=hoff) if np.all(order == np.arange(n)) else _reorder(
            path.stem, unit, arr, ins, outs, hashes, hoff, order)


def _mooncake_columns(path: Path, scale: int, unit: int, max_requests: int | None):
    """The fast reader (msgspec, typed, the whole file at once): (timestamps, tokens, outputs,
    hash ids of full units concatenated, offsets) — or None when msgspec is missing or anything
    is off (a bad line, a negative value), and the checked reader then names the line."""
    try:
        import msgspec
    except ImportError:
        return None
    try:
        recs = msgspec.json.Decoder(_MooncakeRecord).decode_lines(path.read_bytes())
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return None
    if max_requests is not None:
        recs = recs[:max_requests]
    if not recs:
        return None
    n = len(recs)
    ts = np.fromiter((r.timestamp for r in recs), dtype=np.float64, count=n)
    raw_in = np.fromiter((r.input_length for r in recs), dtype=np.int64, count=n)
    outs = np.fromiter((r.output_length for r in recs), dtype=np.int64, count=n)
    if (ts < 0).any() or (raw_in < 0).any() or (outs < 0).any():
        return None
    ins = -(-raw_in // scale)
    have = np.fromiter((len(r.hash_ids) for r in recs), dtype=np.int64, count=n)
    full = np.minimum(have, ins // unit)                 # hash ids of full units only
    try:
        every = np.fromiter(itertools.chain.from_iterable(r.hash_ids for r in recs), dtype=np.int64,
                            count=int(have.sum()))
    except (TypeError, ValueError, OverflowError):
        return None
    if (full == have).all():
        values = every
    else:
        start = np.zeros(n, dtype=np.int64)
        np.cumsum(have[:-1], out=start[1:])
        pos = np.arange(len(every), dtype=np.int64) - np.repeat(start, have)
        values = every[pos < np.repeat(full, have)]
    hoff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(full, out=hoff[1:])
    return ts, ins, np.maximum(outs, 1), values, hoff


def _mooncake_columns_checked(path: Path, scale: int, unit: int, max_requests: int | None):
    """The line-by-line reader: the same columns, or a WorkloadError naming the bad line."""
    ts, ins, outs, ids, lens = [], [], [], [], []
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if max_requests is not None and len(ts) >= max_requests:
                break
            try:
                rec = json.loads(line)
                t, i, o, h = rec["timestamp"], rec["input_length"], rec["output_length"], rec["hash_ids"]
                if not (isinstance(h, list) and isinstance(i, int) and isinstance(o, int) and i >= 0 and o >= 0
                        and isinstance(t, (int, float)) and t >= 0):
                    raise TypeError
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except (KeyError, TypeError):
                raise WorkloadError(f"{path}:{lineno}: a Mooncake record needs timestamp (ms), input_length, "
                                    "output_length (non-negative integers) and hash_ids (a list)") from None
            n_tok = -(-i // scale)
            ts.append(t)
            ins.append(n_tok)
            outs.append(max(1, o))
            full = min(len(h), n_tok // unit)        # hash ids of full units only
            ids.append(h[:full])
            lens.append(full)
    if not ts:
        raise WorkloadError(f"{path}: no requests")
    n = len(ts)
    hoff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=hoff[1:])
    try:
        values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(hoff[-1]))
    except (TypeError, ValueError, OverflowError):
        raise WorkloadError(f"{path}: hash_ids must be integers") from None
    return ts, ins, outs, values, hoff


def _reorder(name, unit, arr, ins, outs, hashes, hoff, order) -> SimTrace:
    ins, outs = np.asarray(ins, dtype=np.int64)[order], np.asarray(outs, dtype=np.int64)[order]
    segs = [hashes[hoff[i]:hoff[i + 1]] for i in order]
    lens = np.array([len(s) for s in segs], dtype=np.int64)
    h2 = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens, out=h2[1:])
    n = len(order)
    return SimTrace(name=name, unit_tokens=unit, conv_ids=[f"r{i:06d}" for i in order], conv_arrival_s=arr[order],
                    conv_offsets=np.arange(n + 1, dtype=np.int64), turn=np.zeros(n, dtype=np.int32),
                    prompt_tokens=ins, max_tokens=outs, think_s=np.zeros(n), arrival_hint_s=arr[order].copy(),
                    hashes=np.concatenate(segs) if segs else hashes, hoffsets=h2)
