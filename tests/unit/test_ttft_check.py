"""The evidence a `kvtier bench ttft` hit row must carry (kvtier/bench/ttft_check.py)."""

from __future__ import annotations

import pytest

from kvtier.bench.ttft_check import HitEvidence, verify_kvtier_hit, verify_prefix_cache_hit


def _ev(**kw) -> HitEvidence:
    base = dict(expect_tokens=768, chunk_tokens=256, reset_ok=True, vllm_cached_tokens=768,
                kvtier_delta={"kvtier_connector_loaded_tokens_total": 768.0,
                              "kvtier_store_hits_total{tier=disk}": 3.0,
                              "kvtier_connector_hit_tokens_total{tier=disk}": 768.0})
    base.update(kw)
    return HitEvidence(**base)


def test_a_real_ssd_hit_passes() -> None:
    assert verify_kvtier_hit(_ev(), "disk") == []


def test_the_same_evidence_does_not_prove_a_ram_hit() -> None:
    bad = verify_kvtier_hit(_ev(), "memory")
    assert any("0 chunk reads served by the memory tier" in b for b in bad)
    assert any("served by the disk tier, not memory" in b for b in bad)


@pytest.mark.parametrize("change,needle", [
    (dict(reset_ok=False), "reset_prefix_cache() returned False"),
    (dict(reset_ok=None), "reset_prefix_cache() returned None"),
    (dict(vllm_cached_tokens=512), "vLLM counted 512 cached tokens"),
    (dict(kvtier_delta={"kvtier_store_hits_total{tier=disk}": 3.0}), "kvtier loaded 0 tokens"),
    (dict(kvtier_delta={"kvtier_connector_loaded_tokens_total": 768.0, "kvtier_store_hits_total{tier=disk}": 3.0,
                        "kvtier_connector_errors_total{kind=load_miss}": 1.0}), "1 connector load errors"),
])
def test_each_missing_proof_is_a_violation(change, needle) -> None:
    bad = verify_kvtier_hit(_ev(**change), "disk")
    assert any(needle in b for b in bad), bad


def test_hit_from_vllms_own_cache_is_not_a_kvtier_hit() -> None:
    # vLLM says cached, but kvtier loaded nothing: the prefix cache served it
    ev = _ev(reset_ok=True, kvtier_delta={})
    bad = verify_kvtier_hit(ev, "disk")
    assert any("kvtier loaded 0" in b for b in bad) and any("0 chunk reads" in b for b in bad)


def test_unknown_tier_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown tier"):
        verify_kvtier_hit(_ev(), "ssd")


def test_prefix_cache_row() -> None:
    assert verify_prefix_cache_hit(896, 896) == [] and verify_prefix_cache_hit(896, 1024) == []
    assert verify_prefix_cache_hit(896, 0) and verify_prefix_cache_hit(896, None)


def test_expected_hit_tokens_uses_a_partly_used_last_chunk() -> None:
    from kvtier.bench.ttft_check import expected_hit_tokens

    assert expected_hit_tokens(600, 256, 128) == 512
    assert expected_hit_tokens(1024, 256, 128) == 896     # 4 chunks stored; vLLM leaves the last block
    assert expected_hit_tokens(1100, 256, 128) == 1024
    ev = _ev(expect_tokens=896, vllm_cached_tokens=896,
             kvtier_delta={"kvtier_connector_loaded_tokens_total": 896.0, "kvtier_store_hits_total{tier=disk}": 4.0})
    assert verify_kvtier_hit(ev, "disk") == []          # (measured: 4 chunk reads for a 1024-token prompt)


def test_a_shared_tier_without_read_counters_is_proved_by_admission_and_no_local_read() -> None:
    ev = _ev(kvtier_delta={"kvtier_connector_loaded_tokens_total": 768.0,
                           "kvtier_connector_hit_tokens_total{tier=shared}": 768.0,
                           "kvtier_store_misses_total{tier=memory}": 3.0})
    assert verify_kvtier_hit(ev, "valkey") == []
    local = _ev(kvtier_delta={"kvtier_connector_loaded_tokens_total": 768.0,
                              "kvtier_connector_hit_tokens_total{tier=shared}": 768.0,
                              "kvtier_store_hits_total{tier=memory}": 3.0})
    assert any("served by the memory tier, not valkey" in b for b in verify_kvtier_hit(local, "valkey"))
    short = _ev(kvtier_delta={"kvtier_connector_loaded_tokens_total": 768.0,
                              "kvtier_connector_hit_tokens_total{tier=shared}": 512.0})
    assert any("512 tokens admitted from the shared tier" in b for b in verify_kvtier_hit(short, "mooncake"))
    # sharedfs counts its reads: the strict rule applies
    assert verify_kvtier_hit(_ev(kvtier_delta={"kvtier_connector_loaded_tokens_total": 768.0,
                                               "kvtier_store_hits_total{tier=sharedfs}": 3.0}), "sharedfs") == []
