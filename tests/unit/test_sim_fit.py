"""Engine-cost fit and miss-ratio curves (exact vs the simulator, SHARDS vs exact)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvtier.sim.costs import StepCost
from kvtier.sim.fit import DecodeSample, PrefillSample, fit_engine
from kvtier.sim.stackdist import access_stream, miss_ratio_curve
from kvtier.sim.trace import load_mooncake_raw


def test_fit_recovers_known_coefficients() -> None:
    true = dict(ov=0.01, tok=2e-4, attn=3e-8, seq=1e-3, req=0.05)
    pre = []
    for n in (100, 400, 1000, 3000):
        for c in (0, 2000):
            steps = math.ceil(n / 512)
            t = true["req"] + steps * true["ov"] + true["tok"] * n + true["attn"] * StepCost.pairs(c, n)
            pre.append(PrefillSample(n, c, t))
    dec = [DecodeSample(d, true["ov"] + true["seq"] * d) for d in (1, 4)]
    f = fit_engine(pre, dec, 512)
    assert f.step_overhead_s == pytest.approx(true["ov"], rel=1e-6)
    assert f.decode_seq_s == pytest.approx(true["seq"], rel=1e-6)
    assert f.prefill_token_s == pytest.approx(true["tok"], rel=1e-4)
    assert f.prefill_attn_s == pytest.approx(true["attn"], rel=1e-4)
    assert f.request_overhead_s == pytest.approx(true["req"], rel=1e-4) and f.prefill_rel_error < 1e-6


def _mooncake_like(tmp_path, n=3000, seed=0, n_prefixes=40):
    import json
    rng = random.Random(seed)
    lines, nxt = [], 10_000
    prefixes = [[rng.randrange(1000) + 1000 * i for i in range(rng.randrange(2, 12))] for _ in range(n_prefixes)]
    for i in range(n):
        p = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
        tail = list(range(nxt, nxt + rng.randrange(1, 6)))
        nxt += len(tail)
        ids = p + tail
        lines.append(json.dumps({"timestamp": i * 10, "input_length": len(ids) * 512 - rng.randrange(300),
                                 "output_length": 4, "hash_ids": ids}))
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return load_mooncake_raw(path)


def test_exact_curve_matches_an_lru_cache_simulated_directly(tmp_path) -> None:
    tr = _mooncake_like(tmp_path, n=600)
    s = access_stream(tr, 512)
    m = miss_ratio_curve(s, 1)
    for cap in (5, 40, 160):
        from collections import OrderedDict
        lru: OrderedDict = OrderedDict()
        hit = 0
        for r in tr.nominal_order().tolist():
            keys = tr.units(r).tolist()
            limit = (int(tr.prompt_tokens[r]) - 1) // 512
            ok = True
            for j, k in enumerate(keys):
                present = k in lru
                ok = ok and present
                if ok and j < limit + 1:
                    hit += min(512, (int(tr.prompt_tokens[r]) - 1) - j * 512) if j == limit else 512
                lru[k] = None
                lru.move_to_end(k)
                if len(lru) > cap:
                    lru.popitem(last=False)
        assert m.at(cap) == pytest.approx(hit / int(tr.prompt_tokens.sum()), abs=0.01), cap


def test_shards_sampling_error_is_small_against_the_exact_curve(tmp_path) -> None:
    tr = _mooncake_like(tmp_path, n=6000, n_prefixes=600)     # SHARDS needs many distinct keys
    s = access_stream(tr, 512)
    exact = miss_ratio_curve(s, 1)
    sampled = miss_ratio_curve(s, 1, rate=0.25)
    caps = np.geomspace(1, exact.capacities_chunks[-1], 30)
    err = max(abs(exact.at(c) - sampled.at(c)) for c in caps)
    assert err < 0.05
    assert abs(sampled.ideal_hit_rate - exact.ideal_hit_rate) < 0.03
