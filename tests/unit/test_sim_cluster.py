"""Several machines sharing one shared tier: a prefix computed on one machine is a shared-tier
hit on another; private tiers alone never see it."""

from __future__ import annotations

import json

from kvtier.sim.cluster import simulate_cluster
from kvtier.sim.load import LoadSpec
from kvtier.sim.profile import EngineProfile, SimProfile, TierProfile
from kvtier.sim.trace import load_mooncake_raw


def test_shared_tier_serves_prefixes_across_machines(tmp_path) -> None:
    p = tmp_path / "mc.jsonl"
    # request i goes to machine i % 2; all share hash ids 0..3, each has one own tail block
    p.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 5 * 512, "output_length": 2,
                                     "hash_ids": [0, 1, 2, 3, 100 + i]}) + "\n" for i in range(6)))
    tr = load_mooncake_raw(p)
    assert tr.subset([1, 3, 5]).conv_ids == ["r000001", "r000003", "r000005"]
    prof = SimProfile(kv_bytes_per_token=100, chunk_size=512,
                      engine=EngineProfile(block_size=16, kv_cache_tokens=7 * 512, prefill_token_s=1e-4),
                      ram=TierProfile(capacity=10**9), shared=TierProfile(capacity=10**9))
    load = LoadSpec(mode="trace")
    alone = simulate_cluster(tr, prof, load, 2, 0)
    shared = simulate_cluster(tr, prof, load, 2, 10**9)
    one = simulate_cluster(tr, prof, load, 1, 0)
    assert alone.tier_hit_rate["shared"] == 0 and shared.tier_hit_rate["shared"] > 0
    assert shared.token_hit_rate > alone.token_hit_rate        # machine 1's first request hits machine 0's prefix
    assert one.token_hit_rate == shared.token_hit_rate          # one machine sees every prefix anyway
    assert shared.requests == alone.requests == 6
