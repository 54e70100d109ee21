"""``connector.save_generated``: chunks covering generated tokens are saved as decode fills them
(and at finish when their ids came late), keyed exactly like a next turn's prompt, and the
finished request's blocks are kept until the worker has copied them. Fake requests/store, CPU
tensors, no model."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata, SaveOutcome
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.keys import chunk_keys, extend_chunk_keys
from tests.unit.test_connector_sides import (
    BLOCK,
    CHUNK,
    NS,
    FakeRequest,
    FakeStore,
    Tables,
    _admit,
    _kv,
    _prompt,
    _worker,
)


@dataclass
class GenRequest(FakeRequest):
    """A request that generates: ``all_token_ids`` = prompt + output (vLLM's ``Request``)."""

    output: list = None

    def __post_init__(self):
        self.output = []

    @property
    def all_token_ids(self):
        return self.prompt_token_ids + self.output

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output)


def _sched(store, save_generated=True):
    s = SchedulerSide(store, NS, block_size=BLOCK, save=True, min_hit_chunks=1, save_generated=save_generated)
    tables = Tables()
    s.bind(tables.per_group)
    return s, tables


def _step(s, tables, req, num_new):
    tables.alloc(req.request_id, req.num_computed_tokens + num_new)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: num_new}))
    req.num_computed_tokens += num_new
    return meta


def _generate(s, tables, req, n, sample=lambda i: 1000 + i):
    """Prefill (one step) then ``n`` decode steps, each sampling one token after the step; returns
    every step's metadata (non-async scheduling: a sampled token is known before its KV step)."""
    metas = [_step(s, tables, req, req.num_prompt_tokens - req.num_computed_tokens)]
    req.output.append(sample(0))
    for i in range(1, n):
        metas.append(_step(s, tables, req, 1))
        req.output.append(sample(i))
    return metas


@given(st.lists(st.integers(0, 2**32 - 1), max_size=5 * CHUNK), st.integers(0, 3), st.integers(0, 6))
@settings(max_examples=60, deadline=None)
def test_extended_keys_equal_keys_of_the_whole_sequence(tokens, start, upto):
    keys = chunk_keys(NS, tokens[:start * CHUNK], b"x")
    n0 = len(keys)
    added = extend_chunk_keys(NS, keys, tokens, upto, b"x")
    want = chunk_keys(NS, tokens, b"x")[:max(n0, upto)]
    assert keys == want and added == len(want) - n0


def test_decode_saves_generated_chunks_with_the_next_turns_keys():
    store = FakeStore()
    s, tables = _sched(store)
    req = GenRequest("a", _prompt(200))
    _admit(s, tables, req)
    metas = _generate(s, tables, req, 330)           # 200 + 330 tokens: chunk 0 and 1 fill during decode
    saves = [(i, c) for i, m in enumerate(metas) for c in m.saves]
    assert [c.chunk_index for _, c in saves] == [0, 1]
    # chunk k is saved in the step that computes its last token (that token was sampled before)
    assert [i for i, _ in saves] == [256 - 200, 512 - 200]
    assert all(c.generated for _, c in saves)
    next_turn = req.all_token_ids[:-1] + [req.all_token_ids[-1]] + _prompt(30, seed=3)
    assert [c.key for _, c in saves] == chunk_keys(NS, next_turn)[:2]
    assert saves[1][1].parent == saves[0][1].key
    assert saves[1][1].block_ids == tuple(tables("a")[2:4])
    assert s.finished(req, (tables("a"),)) is False     # everything already saved: free the blocks now


def test_switch_off_saves_prompt_chunks_only():
    store = FakeStore()
    s, tables = _sched(store, save_generated=False)
    req = GenRequest("a", _prompt(300))
    _admit(s, tables, req)
    metas = _generate(s, tables, req, 300)
    chunks = [c for m in metas for c in m.saves]
    assert [c.chunk_index for c in chunks] == [0] and not chunks[0].generated
    assert s.finished(req, (tables("a"),)) is False


def test_last_sampled_token_and_drafts_are_never_saved():
    store = FakeStore()
    s, tables = _sched(store)
    req = GenRequest("a", _prompt(200))
    _admit(s, tables, req)
    _step(s, tables, req, 200)
    req.output += list(range(55))                     # 255 known tokens: the 256th is not sampled yet
    req.num_computed_tokens = 254
    # one step computes the last known token and 3 speculative drafts (positions 255..257)
    assert _step(s, tables, req, 4).saves == []
    req.num_computed_tokens = 255                     # 3 drafts rejected, 1 accepted: token 255 known
    req.output.append(7)
    meta = _step(s, tables, req, 1)                  # computes position 255 with its known token
    assert [c.chunk_index for c in meta.saves] == [0]


def test_tokens_known_late_are_saved_at_finish_and_blocks_released_after_the_copy():
    """Async scheduling: a step computes a token whose id the scheduler did not know yet."""
    store = FakeStore()
    s, tables = _sched(store)
    req = GenRequest("a", _prompt(200))
    _admit(s, tables, req)
    _step(s, tables, req, 200)
    req.output += list(range(1, 56))                  # 255 tokens known, 255 computed
    req.num_computed_tokens = 255
    assert _step(s, tables, req, 1).saves == []       # position 255's id is a placeholder here
    req.output += [99, 2]                             # ...known now; then the last sampled token (EOS)
    table = list(tables("a"))
    assert s.finished(req, (table,)) is True             # chunk 0 unsaved: keep the blocks
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    (chunk,) = meta.saves
    assert chunk.chunk_index == 0 and chunk.block_ids == tuple(table[:2]) and meta.releases == ["a"]
    assert chunk.key == chunk_keys(NS, req.all_token_ids)[0]
    assert s.build_meta(SimpleNamespace(num_scheduled_tokens={})).releases == []   # shipped once

    kv = _kv(seed=2)
    w = _worker(store, kv)
    assert w.take_released() == set()
    w.save(meta)
    assert store.puts == [chunk.key]
    assert w.take_released() == {"a"} and w.take_released() == set()
    wm = w.take_worker_meta()
    assert wm.saves["a"] == SaveOutcome(1, w.chunk_nbytes, 1, w.chunk_nbytes, 0)


def test_finish_never_counts_the_last_sampled_token():
    store = FakeStore()
    s, tables = _sched(store)
    req = GenRequest("a", _prompt(200))
    _admit(s, tables, req)
    _step(s, tables, req, 200)
    req.output += list(range(1, 57))                  # 256 known tokens; the 256th was just sampled
    req.num_computed_tokens = 256                     # (async: its placeholder step is in flight)
    assert s.finished(req, (tables("a"),)) is False      # its KV slot holds nothing valid yet


def test_release_is_reported_even_when_the_save_fails_or_the_worker_is_disabled():
    store = FakeStore()
    kv = _kv(seed=3)
    w = _worker(store, kv)

    def broken_put(*a, **k):
        raise OSError("disk gone")

    store.put = broken_put
    from kvtier.integrations.vllm.metadata import SaveChunk

    meta = KvtierConnectorMetadata(saves=[SaveChunk("a", 0, b"k" * 32, None, (0, 1), generated=True)],
                                   releases=["a"])
    w.save(meta)
    assert w.take_released() == {"a"}
    assert w.take_worker_meta().saves["a"] == SaveOutcome(0, 0, 0, 0, 1)
    w.disabled = "layout"
    w.save(KvtierConnectorMetadata(saves=list(meta.saves), releases=["b"]))
    assert w.take_released() == {"b"}


def test_a_reply_generated_again_is_not_written_again():
    store = FakeStore()
    s, tables = _sched(store)
    first = GenRequest("a", _prompt(200))
    _admit(s, tables, first)
    for c in (c for m in _generate(s, tables, first, 330) for c in m.saves):
        store.data[c.key] = b"x"
    again = GenRequest("b", _prompt(200))
    _admit(s, tables, again)
    assert [c for m in _generate(s, tables, again, 330) for c in m.saves] == []


def test_worker_reports_sum_over_tensor_parallel_ranks():
    a = KvtierWorkerMetadata(1, saves={"r": SaveOutcome(1, 10, 1, 10, 0)})
    b = KvtierWorkerMetadata(2, saves={"r": SaveOutcome(1, 10, 1, 10, 0), "q": SaveOutcome(0, 0, 0, 0, 1)})
    m = a.aggregate(b)
    assert m.saves == {"r": SaveOutcome(2, 20, 2, 20, 0), "q": SaveOutcome(0, 0, 0, 0, 1)}


def test_saved_generated_kv_loads_back_exactly_for_the_next_turn():
    store = FakeStore()
    s, tables = _sched(store)
    req = GenRequest("a", _prompt(200))
    _admit(s, tables, req)
    kv = _kv(seed=4)
    w = _worker(store, kv)
    for m in _generate(s, tables, req, 330):
        w.save(m)
        w.end_step()
    assert len(store.puts) == 2
    s.finished(req, (tables("a"),))
    turn2 = GenRequest("b", req.all_token_ids + _prompt(30, seed=9))
    s2, tables2 = _sched(store)
    tables2.next = 7
    assert _admit(s2, tables2, turn2) == 512
    dst = {k: torch.zeros_like(v) for k, v in kv.items()}
    w2 = _worker(store, dst)
    w2.load(_step(s2, tables2, turn2, turn2.num_prompt_tokens - 512))
    assert w2.take_load_errors() == set()
    for name in kv:
        for i in range(4):
            assert torch.equal(dst[name][tables2("b")[i]], kv[name][tables("a")[i]])


def test_with_vllms_own_request_class():
    """The attributes the scheduler half reads (all_token_ids, num_tokens, num_computed_tokens,
    num_prompt_tokens and the key fields) on vLLM's real ``Request``, tokens appended its way."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    store = FakeStore()
    s, tables = _sched(store)
    req = Request("r", _prompt(200), SamplingParams(max_tokens=400), None)
    _admit(s, tables, req)
    saves = [_step(s, tables, req, 200).saves]
    req.append_output_token_ids(1000)
    for i in range(1, 330):
        saves.append(_step(s, tables, req, 1).saves)
        req.append_output_token_ids(1000 + i)
    got = [(i, c.chunk_index) for i, step in enumerate(saves) for c in step]
    assert got == [(56, 0), (312, 1)]
    assert [c.key for step in saves for c in step] == chunk_keys(NS, list(req.all_token_ids))[:2]
    assert s.finished(req, (tables("r"),)) is False
