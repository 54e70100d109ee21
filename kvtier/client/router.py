"""A KV-aware router for the lab: each request to the replica whose caches hold its longest prefix.

A measuring tool, not a product: it routes **client-side** (the replay asks ``pick`` for the
server of each request, ``kvtier.client.replay.RequestRouter``), as llm-d's KV cache manager,
Dynamo's KV router or AIBrix do in front of vLLM, from the same input: every replica's KV events.

* ``EventFeed``: one ZMQ SUB socket bound on 127.0.0.1 per replica (its vLLM server's
  ``--kv-events-config`` publisher connects to it: ``kv_events_config``), decoded on one
  background thread into ``BlockIndex.apply``. Payloads are vLLM's msgpack ``KVEventBatch``
  (``[ts, [event, ...], dp_rank]``; vLLM 0.32 encodes each event as a map tagged by ``type``:
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "medium", "extra_keys", ...}``, ``{"type": "BlockRemoved", "block_hashes", "medium"}``,
  ``{"type": "AllBlocksCleared"}``; the array form ``[tag, field, ...]`` in that field order is read
  too), decoded without importing vLLM. Undecodable messages are counted.
* ``BlockIndex`` (pure, thread-safe): a block is known by (parent hash, its tokens, its extra keys:
  the cache salt of a first block), so a request's blocks are found from its token ids alone, no
  hash function needed. For every block: which media hold it on which replica (``gpu``: vLLM's own
  prefix cache, ``ram``, ``ssd``: kvtier's local tiers, ``shared``: kvtier's shared tier, which
  every replica reads, so a ``shared`` block counts for all of them). ``BlockRemoved`` takes a
  medium away on that replica; ``AllBlocksCleared`` empties the replica.
* ``KvAwareRouter.pick``: renders the request's prompt with the model's chat template (token ids
  as the server computes them), scores each replica by the leading blocks it can serve (any of its
  media, or the shared tier), then by the leading blocks in its own media, then fewest requests in
  flight, then replica order. ``stats()`` counts decisions made on a prefix and ties.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

#: vLLM's ``medium`` values -> the tier names the cluster report uses
MEDIA = {"GPU": "gpu", "CPU": "ram", "DISK": "ssd", "SHARED": "shared"}
SHARED = "shared"
TOPIC = b"kv-events"


def medium_name(medium: Any) -> str:
    """The report's name for an event's ``medium`` (None: vLLM's own cache, ``gpu``)."""
    if medium is None:
        return "gpu"
    return MEDIA.get(str(medium).upper(), str(medium).lower())


def _extra(value: Any) -> tuple | None:
    if not value:
        return None
    return tuple(_extra(v) if isinstance(v, list) else v for v in value)


@dataclass(frozen=True)
class Stored:
    """One ``BlockStored`` (several consecutive blocks)."""

    block_hashes: tuple
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    extra_keys: tuple | None = None          # one entry per block (None: no extra keys)


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple
    medium: str


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _hashable(h: Any) -> Any:
    """A block hash as a dict key: bytes or int as decoded; bytearray -> bytes, array -> tuple."""
    if isinstance(h, (bytearray, memoryview)):
        return bytes(h)
    return tuple(h) if isinstance(h, list) else h


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    """An event's fields by name, from its map form (``{"type": ..., name: value}``) or its array form
    (``[tag, value, ...]`` in ``names`` order)."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def decode_event(raw: Any) -> Event | None:
    """One tagged event (map or array, module docstring) -> ``Stored`` / ``Removed`` / ``Cleared``;
    None when unknown or malformed."""
    tag = raw.get("type") if isinstance(raw, dict) else (raw[0] if raw else None)
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        if not all(k in f for k in _STORED_FIELDS[:4]):
            return None
        extra = f.get("extra_keys")
        return Stored(tuple(_hashable(h) for h in f["block_hashes"]),
                      _hashable(f["parent_block_hash"]) if f["parent_block_hash"] is not None else None,
                      tuple(int(t) for t in f["token_ids"]), int(f["block_size"]), medium_name(f.get("medium")),
                      tuple(_extra(e) if isinstance(e, list) else e for e in extra) if extra else None)
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        if "block_hashes" not in f:
            return None
        return Removed(tuple(_hashable(h) for h in f["block_hashes"]), medium_name(f.get("medium")))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> list[Event]:
    """A msgpack ``KVEventBatch`` -> its events (unknown ones dropped); ValueError when undecodable."""
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KVEventBatch array")
    return [e for e in (decode_event(x) for x in batch[1] if isinstance(x, (list, dict))) if e is not None]


@dataclass(frozen=True)
class Match:
    """What one replica can serve of a prompt, in blocks."""

    blocks: int          # leading blocks in any of its media or the shared tier
    local_blocks: int    # leading blocks in its own media (gpu / ram / ssd)


class BlockIndex:
    """Which replica holds which block in which medium (module docstring). Thread-safe."""

    def __init__(self, replicas: Sequence[str]):
        self.replicas = tuple(replicas)
        self._lock = threading.Lock()
        self._child: dict[tuple, Any] = {}                       # (parent, tokens, extra) -> block hash
        self._held: dict[Any, dict[str, set[str]]] = defaultdict(dict)   # hash -> replica -> media
        self.block_size: int | None = None
        self.counts: dict[str, int] = defaultdict(int)

    def apply(self, replica: str, event: Event) -> None:
        with self._lock:
            self.counts[type(event).__name__] += 1
            if isinstance(event, Cleared):
                for held in self._held.values():
                    held.pop(replica, None)
            elif isinstance(event, Removed):
                for h in event.block_hashes:
                    media = self._held.get(h, {}).get(replica)
                    if media is not None:
                        media.discard(event.medium)
            else:
                self._stored(replica, event)

    def _stored(self, replica: str, ev: Stored) -> None:
        bs = ev.block_size
        if self.block_size is None:
            self.block_size = bs
        if bs != self.block_size or len(ev.token_ids) < bs * len(ev.block_hashes):
            self.counts["skipped"] += 1
            return
        parent = ev.parent
        for i, h in enumerate(ev.block_hashes):
            extra = ev.extra_keys[i] if ev.extra_keys and i < len(ev.extra_keys) else None
            self._child[(parent, ev.token_ids[i * bs:(i + 1) * bs], extra or None)] = h
            self._held[h].setdefault(replica, set()).add(ev.medium)
            parent = h

    def chain(self, tokens: Sequence[int], first_extra: tuple | None = None) -> list[Any]:
        """The hashes of the prompt's leading full blocks the index knows (stops at the first unknown)."""
        with self._lock:
            bs = self.block_size
            if not bs:
                return []
            out: list[Any] = []
            parent = None
            for i in range(len(tokens) // bs):
                h = self._child.get((parent, tuple(tokens[i * bs:(i + 1) * bs]), first_extra if i == 0 else None))
                if h is None:
                    break
                out.append(h)
                parent = h
            return out

    def match(self, tokens: Sequence[int], first_extra: tuple | None = None) -> dict[str, Match]:
        """Per replica: leading blocks it can serve, and those in its own media."""
        hashes = self.chain(tokens, first_extra)
        out: dict[str, Match] = {}
        with self._lock:
            held = [self._held.get(h, {}) for h in hashes]
            shared = [any(SHARED in m for m in x.values()) for x in held]
            for r in self.replicas:
                own = [bool((x.get(r) or set()) - {SHARED}) for x in held]
                local = next((i for i, v in enumerate(own) if not v), len(own))
                total = next((i for i, (v, s) in enumerate(zip(own, shared)) if not (v or s)), len(own))
                out[r] = Match(total, local)
        return out


def choose(matches: dict[str, Match], inflight: dict[str, int], order: Sequence[str]) -> str:
    """Longest prefix it can serve, then longest in its own media, then fewest in flight, then order."""
    return min(order, key=lambda r: (-matches[r].blocks, -matches[r].local_blocks, inflight.get(r, 0), order.index(r)))


def kv_events_config(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """The ``--kv-events-config`` of a replica whose events go to the feed's socket on ``port``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:{port}",
            "topic": TOPIC.decode()}


class EventFeed:
    """SUB sockets bound on 127.0.0.1 (one per replica) feeding a ``BlockIndex`` from a thread."""

    def __init__(self, ports: dict[str, int], index: BlockIndex, host: str = "127.0.0.1"):
        self.ports, self.index, self.host = dict(ports), index, host
        self.errors = 0
        self.messages = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = None
        self._socks: dict[Any, str] = {}

    def start(self) -> "EventFeed":
        import zmq

        self._ctx = zmq.Context()
        for name, port in self.ports.items():
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, TOPIC)
            s.bind(f"tcp://{self.host}:{port}")
            self._socks[s] = name
        self._thread = threading.Thread(target=self._run, name="kv-event-feed", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                try:
                    parts = s.recv_multipart(zmq.NOBLOCK)
                    events = decode_batch(parts[-1])
                except (zmq.ZMQError, ValueError, IndexError):
                    self.errors += 1
                    continue
                self.messages += 1
                for ev in events:
                    self.index.apply(self._socks[s], ev)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in self._socks:
            s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._socks.clear()


@dataclass
class KvAwareRouter:
    """``RequestRouter`` over ``replicas`` ((name, base URL), in order) from a ``BlockIndex``.

    ``salt``: the cache salt the requests carry (part of a first block's key); ``tokenizer``
    renders chat messages to token ids (``kvtier.workload.tokens``)."""

    replicas: tuple[tuple[str, str], ...]
    index: BlockIndex
    tokenizer: Any
    salt: str | None = None
    inflight: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def pick(self, conv: Any, k: int, messages: list[dict[str, str]] | None) -> tuple[str, str]:
        turn = conv.turns[k]
        tokens = turn.prompt_token_ids if turn.prompt_token_ids is not None else \
            self.tokenizer.render_chat(messages if messages is not None else conv.chat_messages(k))
        order = [name for name, _ in self.replicas]
        matches = self.index.match(tokens, (self.salt,) if self.salt else None)
        name = choose(matches, self.inflight, order)
        best = matches[name].blocks
        self.decisions["prefix" if best > 0 else "no_prefix"] += 1
        if best > 0 and sum(m.blocks == best for m in matches.values()) > 1:
            self.decisions["tie"] += 1
        self.inflight[name] = self.inflight.get(name, 0) + 1
        return name, dict(self.replicas)[name]

    def finished(self, replica: str) -> None:
        self.inflight[replica] = max(0, self.inflight.get(replica, 0) - 1)

    def stats(self) -> dict[str, Any]:
        return {"decisions": dict(self.decisions), "events": dict(self.index.counts)}
