"""Models that are not one full-attention group, served with vLLM's hybrid KV cache manager on: a hit
from each tier (RAM, SSD in a new process, the shared directory alone in a new process) gives the same
greedy ids and top-k logprobs as vLLM without kvtier, float32.

- Gemma 3 270M (the second bundled model): 5 sliding-window groups (window 512) + 1 full-attention group
  of 3 layers each. A 1,100-token prompt's hit at 1,024 tokens loads every full-attention block and only
  the sliding-window blocks vLLM keeps for token 1,024 (blocks 4-7); a 700-token prompt's hit lies inside
  the window. vLLM's HMA stays on, and the KV blocks vLLM allocates are the same with and without kvtier.

Each role is a driver process (``model_hit_driver.py``); the engines run one after another.
Budget: about 3.5 minutes on a 2-core CPU (four Gemma engine starts, ~25 s each, and eight prefills).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integration.driver_result import driver_result
from tests.integration.test_connector_e2e import EXACT_TOL, mismatches

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("model_hit_driver.py")
BLOCK = 128


def _run(role: str, model: Path, out: Path, *extra: str, dtype: str = "float32") -> dict:
    env = dict(os.environ)
    env.pop("KVTIER_STORE__DISK__PATH", None)
    err = out.with_suffix(".stderr")
    with open(err, "w") as ef:
        proc = subprocess.Popen([sys.executable, str(DRIVER), role, "--model", str(model), "--dtype", dtype,
                                 "--out", str(out), *extra], env=env, stdout=subprocess.DEVNULL, stderr=ef, text=True)
    return driver_result(proc, out, err, f"model driver {role}", 900)["phases"]


@pytest.fixture(scope="module")
def gemma_runs(tmp_path_factory):
    from kvtier.models import GEMMA3, model_status

    model = GEMMA3.path()
    if not model_status(model, GEMMA3).ready:
        pytest.fail(f"the bundled {GEMMA3.name} is not prepared: run `make setup`")
    tmp = tmp_path_factory.mktemp("gemma")
    disk, shared = tmp / "disk", tmp / "shared"
    common = ("--disk", str(disk), "--shared", str(shared))
    return {"reference": _run("reference", model, tmp / "reference.json"),
            "writer": _run("writer", model, tmp / "writer.json", *common, "--log", str(tmp / "writer.log")),
            "ssd": _run("reader", model, tmp / "ssd.json", *common, "--tier", "ssd", "--log", str(tmp / "ssd.log")),
            "shared": _run("reader", model, tmp / "shared.json", *common, "--tier", "shared",
                           "--log", str(tmp / "shared.log"))}


def _hit(prompt_len: int) -> int:
    """kvtier's full hit: whole 256-token chunks, cut to whole blocks before the last token."""
    return min(prompt_len // 256 * 256, (prompt_len - 1) // BLOCK * BLOCK)


def _check(reference: dict, phase: dict, claimed: int) -> None:
    (req,) = phase["requests"]
    bad = mismatches(reference[req["name"]]["requests"][0], req, EXACT_TOL)
    assert not bad, (req["name"], bad[:5])
    claims = [e for e in phase["log"] if e["event"] == "claim"]
    loads = [e for e in phase["log"] if e["event"] == "load"]
    assert [c["claimed_tokens"] for c in claims] == ([claimed] if claimed else [])
    assert [(e["loaded_tokens"], e["failed_tokens"]) for e in loads] == ([(claimed, 0)] if claimed else [])
    assert req["num_cached_tokens"] == claimed
    assert phase["vllm"]["vllm:external_prefix_cache_hits"] == claimed


def test_gemma_keeps_vllms_hybrid_kv_cache_manager_and_its_memory(gemma_runs):
    ref, writer = gemma_runs["reference"]["engine"], gemma_runs["writer"]["engine"]
    assert writer["hma_disabled"] is False
    kinds = [k for k, _ in writer["groups"]]
    assert kinds.count("SlidingWindowSpec") == 5 and kinds.count("FullAttentionSpec") == 1
    assert writer["groups"] == ref["groups"] and writer["num_blocks"] == ref["num_blocks"]


@pytest.mark.parametrize("prompt", ["doc_1100", "doc_700"])
def test_gemma_cold_runs_with_kvtier_match_vllm_alone(gemma_runs, prompt):
    _check(gemma_runs["reference"], gemma_runs["writer"][f"cold_{prompt}"], 0)


@pytest.mark.parametrize("tier, role", [("ram", "writer"), ("ssd", "ssd"), ("shared", "shared")])
@pytest.mark.parametrize("prompt, length", [("doc_1100", 1100), ("doc_700", 700)])
def test_gemma_hits_from_every_tier_match_vllm_alone(gemma_runs, tier, role, prompt, length):
    phase = gemma_runs[role][f"{tier}_{prompt}"]
    assert phase["reset_ok"] is not False
    _check(gemma_runs["reference"], phase, _hit(length))


# -- seeded random-initialised tiny checkpoints (``kvtier.models.tiny``) ---------------------------------
def _hits_equal_cold(model: Path, tmp: Path, *extra: str, dtype: str = "float32") -> list[str]:
    """RAM and SSD hits equal a cold recompute in the same engine (its greedy ids and top-k logprobs); the
    namespaces' layouts of the chunks written. ``extra``: more driver arguments."""
    disk = ("--disk", str(tmp / "disk"), *extra)
    writer = _run("writer", model, tmp / "writer.json", *disk, "--log", str(tmp / "writer.log"), dtype=dtype)
    ssd = _run("reader", model, tmp / "ssd.json", *disk, "--tier", "ssd", "--log", str(tmp / "ssd.log"), dtype=dtype)
    block = writer["engine"]["block_size"]
    for prompt, length in (("doc_1100", 1100), ("doc_700", 700)):
        cold = {prompt: writer[f"cold_{prompt}"]}
        hit = min(length // 256 * 256, (length - 1) // block * block)
        _check(cold, writer[f"ram_{prompt}"], hit)
        _check(cold, ssd[f"ssd_{prompt}"], hit)
    return [json.loads(p.read_text())["namespace"]["layout"] for p in (tmp / "disk").glob("*/namespace.json")]


def test_every_layer_windowed_hits_from_ram_and_ssd_equal_a_cold_recompute(tiny_model, tmp_path):
    """A tiny Mistral whose every layer has a 256-token window (one sliding-window group): only the window
    is loaded (the hit at 1,024 loads blocks 6-7), outputs unchanged. Its chunks are stored per KV head
    (``tp_layout: per-kv-head``; the bundled Gemma 3 covers a window stored per rank)."""
    assert _hits_equal_cold(tiny_model("mistral-swa"), tmp_path, "--tp-layout", "per-kv-head") == \
        ["lbhnc/sliding_window256x2/kvhead"]


def test_mla_hits_equal_a_cold_recompute_or_are_refused_where_vllm_cannot_use_them(tiny_model, tmp_path):
    """A tiny DeepSeek-V2 (MLA, block 16). vLLM's reference CPU MLA attention computes no prefill over a cached
    context (vLLM turns chunked prefill and prefix caching off; measured: a loaded prefix changes logprobs by
    0.03 and the ids from token 5): there kvtier refuses it at start; where vLLM keeps chunked prefill on
    (its AMX MLA kernels), RAM and SSD hits must equal a cold recompute."""
    model = tiny_model("deepseek-mla")
    served = _run("start", model, tmp_path / "served.json", "--on-unsupported", "serve-without-cache")
    if served["engine"]["chunked_prefill"]:
        assert _hits_equal_cold(model, tmp_path) == ["lbhnc/mlax2"]
        return
    with pytest.raises(AssertionError) as failed:
        _run("start", model, tmp_path / "refused.json")
    assert "kvtier cannot serve this engine" in str(failed.value)
    assert "MLA on vLLM's reference CPU attention" in str(failed.value)
    assert len(served["doc_1100"]["requests"][0]["ids"]) == 32      # served without the cache meanwhile


def test_a_mamba_hybrids_state_hits_equal_vllms_own_prefix_cache_hit(tiny_model, tmp_path):
    """Qwen3-Next-style Gated DeltaNet + attention (bfloat16: vLLM's CPU GDN kernel needs it), vLLM's "align"
    prefix caching (block 384): each chunk is one block and carries the state at its end, taken from the block
    vLLM offers for that boundary. A RAM hit and an SSD hit (new process) load the attention KV and only the
    state at the hit; their greedy ids and top-k logprobs equal vLLM's own prefix-cache hit of the same prompt
    (a cold bfloat16 prefill computes the state in other steps, so it is not the oracle), HMA on."""
    model = tiny_model("qwen3-next")
    disk = ("--disk", str(tmp_path / "disk"))
    writer = _run("writer", model, tmp_path / "writer.json", *disk, "--vllm-hit", dtype="bfloat16")
    ssd = _run("reader", model, tmp_path / "ssd.json", *disk, "--tier", "ssd", dtype="bfloat16")
    assert writer["engine"]["hma_disabled"] is False
    block = writer["engine"]["block_size"]
    for prompt, length in (("doc_1100", 1100), ("doc_700", 700)):
        hit = (length - 1) // block * block
        oracle = writer[f"vllm_{prompt}"]["requests"][0]
        assert oracle["num_cached_tokens"] == hit, prompt                       # vLLM's own hit, same length
        for phase in (writer[f"ram_{prompt}"], ssd[f"ssd_{prompt}"]):
            (req,) = phase["requests"]
            assert not mismatches(oracle, req, EXACT_TOL), prompt
            assert req["num_cached_tokens"] == hit == phase["vllm"]["vllm:external_prefix_cache_hits"], prompt
    spaces = [json.loads(p.read_text())["namespace"] for p in (tmp_path / "disk").glob("*/namespace.json")]
    assert [(ns["layout"], ns["chunk_size"]) for ns in spaces] == [("lbhnc/mambax1,mambax1,mambax1,fullx1", block)]


def test_tp2_ranks_save_and_load_their_share_and_one_rank_failing_recomputes_on_every_rank(tiny_model, tmp_path):
    """A tiny Llama with 4 KV heads on two tensor-parallel ranks (one core each): each rank saves its two heads
    under its own namespace, a RAM hit equals a cold recompute; in a new process with every SSD chunk of rank 1
    corrupted, the SSD hit is claimed, rank 1's loads fail, vLLM recomputes the request on both ranks (failed
    block ids are merged over the ranks) and the output is still the cold one. (TP = 2 hits from a tier in a new
    process: the per-KV-head test below.)"""
    model = tiny_model("llama-kv4")
    disk = ("--disk", str(tmp_path / "disk"), "--tp", "2")
    writer = _run("writer", model, tmp_path / "writer.json", *disk, "--log", str(tmp_path / "writer.log"))
    spaces = [json.loads(p.read_text())["namespace"] for p in (tmp_path / "disk").glob("*/namespace.json")]
    assert sorted((ns["tp_rank"], ns["tp_size"]) for ns in spaces) == [(0, 2), (1, 2)]
    log = tmp_path / "broken.log"
    broken = _run("reader", model, tmp_path / "broken.json", *disk, "--tier", "ssd", "--corrupt-rank", "1",
                  "--log", str(log))
    assert broken["corrupted"] > 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    claims = [e for e in events if e["event"] == "claim"]
    loads = [e for e in events if e["event"] == "load"]
    assert len(claims) == 2 and all(e["claimed_tokens"] > 0 for e in claims)          # the SSD hits were claimed
    assert len(loads) == 2 and all(e["failed_tokens"] > 0 for e in loads)             # and rank 1 failed them
    for prompt, length in (("doc_1100", 1100), ("doc_700", 700)):
        cold = {prompt: writer[f"cold_{prompt}"]}
        hit = min(length // 256 * 256, (length - 1) // BLOCK * BLOCK)
        (req,) = writer[f"ram_{prompt}"]["requests"]
        assert not mismatches(cold[prompt]["requests"][0], req, EXACT_TOL)
        assert req["num_cached_tokens"] == hit == writer[f"ram_{prompt}"]["vllm"]["vllm:external_prefix_cache_hits"]
        (req,) = broken[f"ssd_{prompt}"]["requests"]
        assert not mismatches(cold[prompt]["requests"][0], req, EXACT_TOL), prompt


def test_tp1_and_tp2_replicas_read_each_others_chunks_stored_per_kv_head(tiny_model, tmp_path):
    """``connector.tp_layout: per-kv-head``: the tiny Llama's 4 KV heads are stored one entry each, the same
    bytes at any TP size. A TP = 2 engine writes (its RAM hit needs every head, held by two ranks); a TP = 1
    engine in a new process reads its chunks from the shared directory alone, and a TP = 2 engine reads what
    a TP = 1 engine wrote: each hit equals its own TP size's cold recompute, float32."""
    model = tiny_model("llama-kv4")
    heads = ("--tp-layout", "per-kv-head")
    by_two, by_one = tmp_path / "by-tp2", tmp_path / "by-tp1"
    w2 = _run("writer", model, tmp_path / "w2.json", "--disk", str(tmp_path / "d2"), "--shared", str(by_two),
              "--tp", "2", *heads)
    w1 = _run("writer", model, tmp_path / "w1.json", "--disk", str(tmp_path / "d1"), "--shared", str(by_one), *heads)
    spaces = {json.loads(p.read_text())["namespace"]["layout"] + str(json.loads(p.read_text())["namespace"]["tp_size"])
              for d in (by_two, by_one) for p in d.glob("*/namespace.json")}
    assert spaces == {"lbhnc/kvhead1"}                               # one namespace for both TP sizes
    r1 = _run("reader", model, tmp_path / "r1.json", "--shared", str(by_two), "--tier", "shared", *heads)
    r2 = _run("reader", model, tmp_path / "r2.json", "--shared", str(by_one), "--tier", "shared", "--tp", "2",
              *heads)
    for prompt, length in (("doc_1100", 1100), ("doc_700", 700)):
        hit = min(length // 256 * 256, (length - 1) // BLOCK * BLOCK)
        for cold, phase in ((w2, w2[f"ram_{prompt}"]), (w1, w1[f"ram_{prompt}"]),
                            (w1, r1[f"shared_{prompt}"]), (w2, r2[f"shared_{prompt}"])):
            (req,) = phase["requests"]
            assert not mismatches(cold[f"cold_{prompt}"]["requests"][0], req, EXACT_TOL), prompt
            assert req["num_cached_tokens"] == hit == phase["vllm"]["vllm:external_prefix_cache_hits"], prompt
