"""The lab's KV-aware router on fake KV events (kvtier.client.router): longest prefix, ties, removals."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.client.router import (BlockIndex, Cleared, KvAwareRouter, Match, Removed, Stored, choose,
                                  decode_batch, decode_event, medium_name)
from kvtier.workload.format import Conversation, Turn

BS = 4


def _blocks(tokens: list[int], salt: str | None = None) -> list[tuple]:
    """Fake vLLM block hashes: the chain of (parent, block tokens, extra) itself."""
    out, parent = [], None
    for i in range(len(tokens) // BS):
        extra = (salt,) if salt and i == 0 else None
        h = ("h", parent, tuple(tokens[i * BS:(i + 1) * BS]), extra)
        out.append(h)
        parent = h
    return out


def _stored(tokens: list[int], medium: str, first: int = 0, salt: str | None = None) -> Stored:
    """A BlockStored for blocks ``first..`` of ``tokens`` (parent = the block before)."""
    hs = _blocks(tokens, salt)
    extra = tuple((salt,) if salt and i == 0 else None for i in range(first, len(hs)))
    return Stored(tuple(hs[first:]), hs[first - 1] if first else None, tuple(tokens[first * BS:len(hs) * BS]), BS,
                  medium, extra)


PROMPT = list(range(100, 124))           # 6 blocks


def test_longest_prefix_wins():
    idx = BlockIndex(["r0", "r1"])
    idx.apply("r0", _stored(PROMPT[:8], "gpu"))          # 2 blocks
    idx.apply("r1", _stored(PROMPT[:20], "ssd"))         # 5 blocks
    m = idx.match(PROMPT)
    assert m == {"r0": Match(2, 2), "r1": Match(5, 5)}
    assert choose(m, {"r0": 0, "r1": 9}, ["r0", "r1"]) == "r1"


def test_ties_go_to_the_least_loaded_then_the_first():
    idx = BlockIndex(["r0", "r1", "r2"])
    for r in ("r0", "r1", "r2"):
        idx.apply(r, _stored(PROMPT[:12], "ram"))
    m = idx.match(PROMPT)
    assert choose(m, {"r0": 2, "r1": 1, "r2": 1}, ["r0", "r1", "r2"]) == "r1"
    assert choose(m, {}, ["r0", "r1", "r2"]) == "r0"


def test_block_removed_takes_one_medium_away():
    idx = BlockIndex(["r0", "r1"])
    idx.apply("r0", _stored(PROMPT, "gpu"))
    idx.apply("r0", _stored(PROMPT[:8], "ram"))
    hs = _blocks(PROMPT)
    idx.apply("r0", Removed(tuple(hs[1:]), "gpu"))       # gpu keeps block 0, ram keeps 0..1
    assert idx.match(PROMPT)["r0"] == Match(2, 2)
    idx.apply("r0", Removed(tuple(hs[:2]), "ram"))
    assert idx.match(PROMPT)["r0"] == Match(1, 1)
    idx.apply("r0", Cleared())
    assert idx.match(PROMPT)["r0"] == Match(0, 0)


def test_shared_blocks_count_for_every_replica_local_breaks_the_tie():
    idx = BlockIndex(["r0", "r1"])
    idx.apply("r1", _stored(PROMPT[:16], "shared"))     # announced by r1, readable by both
    idx.apply("r1", _stored(PROMPT[:8], "ssd"))
    m = idx.match(PROMPT)
    assert m["r0"] == Match(4, 0) and m["r1"] == Match(4, 2)
    assert choose(m, {"r1": 3}, ["r0", "r1"]) == "r1"   # same prefix, r1 holds more of it locally


def test_a_block_stored_later_extends_the_chain_through_its_parent():
    idx = BlockIndex(["r0"])
    idx.apply("r0", _stored(PROMPT[:8], "gpu"))
    idx.apply("r0", _stored(PROMPT[:16], "ssd", first=2))
    assert idx.match(PROMPT)["r0"] == Match(4, 4)


def test_the_salt_keeps_runs_apart():
    idx = BlockIndex(["r0", "r1"])
    idx.apply("r0", _stored(PROMPT, "gpu", salt="run-a"))
    idx.apply("r1", _stored(PROMPT[:8], "gpu", salt="run-b"))
    assert idx.match(PROMPT, ("run-a",))["r0"].blocks == 6
    assert idx.match(PROMPT, ("run-b",)) == {"r0": Match(0, 0), "r1": Match(2, 2)}
    assert idx.match(PROMPT)["r0"].blocks == 0


def test_other_block_sizes_are_skipped_and_counted():
    idx = BlockIndex(["r0"])
    idx.apply("r0", _stored(PROMPT[:8], "gpu"))
    idx.apply("r0", Stored((("x",),), None, tuple(PROMPT[:16]), 16, "gpu"))
    assert idx.counts["skipped"] == 1


class _Tok:
    def render_chat(self, messages):
        return [int(x) for m in messages for x in m["content"].split()]


def test_router_picks_counts_in_flight_and_releases():
    idx = BlockIndex(["r0", "r1"])
    idx.apply("r1", _stored(PROMPT, "ram"))
    router = KvAwareRouter((("r0", "http://a"), ("r1", "http://b")), idx, _Tok())
    conv = Conversation(id="c", turns=[Turn(prompt_token_ids=PROMPT, max_tokens=1)])
    assert router.pick(conv, 0, None) == ("r1", "http://b")
    assert router.inflight == {"r1": 1}
    other = Conversation(id="d", turns=[Turn(user="7 7 7 7 7 7 7 7", max_tokens=1)])
    assert router.pick(other, 0, [{"role": "user", "content": "7 7 7 7 7 7 7 7"}])[0] == "r0"   # no prefix: least loaded
    router.finished("r1")
    assert router.inflight == {"r1": 0, "r0": 1}
    assert router.stats()["decisions"] == {"prefix": 1, "no_prefix": 1}


def test_decode_vllm_batches_map_and_array_forms():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    batch = [1.5, [{"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
                    "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "CPU",
                    "lora_name": None, "extra_keys": [["salt"], None]},
                   ["BlockRemoved", [h1], "DISK"], {"type": "AllBlocksCleared"}, {"type": "Unknown"}], None]
    events = decode_batch(msgspec.msgpack.encode(batch))
    assert events[0] == Stored((h1, h2), None, tuple(range(8)), 4, "ram", (("salt",), None))
    assert events[1] == Removed((h1,), "ssd")
    assert events[2] == Cleared()
    assert len(events) == 3
    assert decode_event({"type": "BlockStored", "block_hashes": [h1]}) is None
    assert [medium_name(m) for m in ("GPU", None, "SHARED", "odd")] == ["gpu", "gpu", "shared", "odd"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2"]), st.integers(1, 6),
                          st.sampled_from(["gpu", "ram", "ssd", "shared"])), max_size=12))
def test_match_is_the_longest_stored_prefix(stores):
    """Without removals a replica's match is the longest prefix it (or anyone, for shared) stored."""
    idx = BlockIndex(["r0", "r1", "r2"])
    for r, n, medium in stores:
        idx.apply(r, _stored(PROMPT[:n * BS], medium))
    m = idx.match(PROMPT)
    shared = max([n for _, n, md in stores if md == "shared"], default=0)
    for r in ("r0", "r1", "r2"):
        local = max([n for rr, n, md in stores if rr == r and md != "shared"], default=0)
        assert m[r] == Match(max(local, shared), local)
