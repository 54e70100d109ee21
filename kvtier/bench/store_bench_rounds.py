"""What one ``kvtier bench store`` run measures and how its rounds are summarised: the model chunk
sizes, the disk tier variants, and the per-round statistics (medians with min/max, per-round
ratios, alternating pass order). Pure functions."""

from __future__ import annotations

import statistics

from kvtier.compute import kv_bytes


# KV bytes per token (bf16) of the bundled SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) and of a
# 7B-class GQA model (Qwen2.5-7B: 28 layers, 4 KV heads, head_dim 128): 23,040 and 57,344 B.
MODELS = {"default": kv_bytes(30, 3, 64, 2), "7b": kv_bytes(28, 4, 128, 2)}
TOKENS = 256
GB = 1e9
# disk tier variants: name -> (o_direct writes, o_direct reads)
VARIANTS = {"direct": (True, True), "direct_async": (True, True), "direct_write": (True, False),
            "buffered": (False, False)}
WRITER_THREADS = 2          # the disk tier's default writer pool (store.disk.writer_threads)
HEADLINE = "direct"


def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant figures: a slow medium's 0.0123 GB/s keeps its digits (3 decimals
    kept one or two, and a per-round ratio recomputed from them was off by several percent)."""
    return float(f"{x:.{digits}g}")


def spread(xs: list[float]) -> dict:
    """Median, min and max of one figure's per-round values (4 significant figures)."""
    return {"median": sig(statistics.median(xs)), "min": sig(min(xs)), "max": sig(max(xs))}


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Per-round ratios num[i]/den[i]: their median, min and max, and the ratio of the medians."""
    rs = [a / b for a, b in zip(num, den, strict=True)]
    return {**spread(rs), "of_medians": sig(statistics.median(num) / statistics.median(den))}


def order(round_index: int, first: str, second: str) -> tuple[str, str]:
    """The two back-to-back passes of a round; the order alternates between rounds."""
    return (first, second) if round_index % 2 == 0 else (second, first)


def percentile_ms(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] * 1e3


def latency_ms(xs: list[float]) -> dict:
    return {"p50_ms": round(percentile_ms(xs, 50), 3), "p99_ms": round(percentile_ms(xs, 99), 3)}


def ceiling(variants: dict[str, list[float]]) -> tuple[list[float], list[str]]:
    """Per round: the best (max) of the plain-I/O variants measured in that round, and its name.
    The variants must hold one figure per round each."""
    if not variants:
        raise ValueError("a ceiling needs at least one plain-I/O variant")
    rounds = {len(v) for v in variants.values()}
    if len(rounds) != 1:
        raise ValueError(f"variants hold different numbers of rounds: {sorted(rounds)}")
    names = sorted(variants)
    best = [max(names, key=lambda k: variants[k][i]) for i in range(rounds.pop())]
    return [variants[k][i] for i, k in enumerate(best)], best


def against_ceiling(tier: list[float], variants: dict[str, list[float]]) -> dict:
    """A tier's per-round figures against the ceiling of the same rounds (``ceiling``): the ceiling's
    spread, the per-round ratios (each <= the ratio to every single variant of that round), the
    variant that set the ceiling in each round, every variant's spread, and the rounds (0-based)
    where the tier beat every variant (the ceiling was no ceiling there: reported, never hidden)."""
    best, which = ceiling(variants)
    return {"gbps": spread(best), "ratio": ratio_stats(tier, best), "best_per_round": which,
            "per_round": [sig(x) for x in best], "variants": {k: spread(v) for k, v in sorted(variants.items())},
            "variants_per_round": {k: [sig(x) for x in v] for k, v in sorted(variants.items())},
            "rounds_above": [i for i, (t, b) in enumerate(zip(tier, best, strict=True)) if t > b]}
