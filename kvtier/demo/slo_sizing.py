"""How long ``kvtier demo slo`` will take on this machine, and the size that fits its time target.

The SLO demo's cost is requests x service time, and on a slow CPU vanilla's requests dominate:
every vanilla request is a cold prefill of a whole document (the fixed high-concurrency point
alone is ``repeats x min_requests_per_user x fixed_users`` of them per length). The 2026-12-01 run
on the 2-vCPU AVX2 machine (282 / 564 / 1128-token documents, the published-size defaults) spent
~44 min on vanilla and was cut off at 50 min: the "about 15 minutes" of the help text held only on
the AVX-512 machine it was written on.

Model (side-effect free; the calibration's ``PrefillProfile`` p(n) = a + b n + c n^2):

* service time per request: vanilla ``p(doc + overhead)``; kvtier (document cached) the cold
  prefill of the question and the document's partial last chunk, ``p(overhead + chunk / 2)``.
* a point of N closed-loop users on the one engine: requests are served in batches of N, one batch
  costs ``a + N (s - a)`` (the fixed cost shared, the token work summed), so p90 TTFT ~ that batch
  time and the point lasts ``R / N`` batches. The SLO search is replayed on this model
  (``kvtier.client.slo.search`` itself) to know which points it visits.
* warm-up: ``warm_questions`` per document, the first cold, later ones hits (kvtier) / cold (vanilla).

``fit_slo_size`` shrinks, in this order and only as far as needed, the fixed point's users (not
below ``MIN_FIXED_USERS``), the warm-up questions (not below 1) and the requests per user (not below
3, ``MIN_STEADY_ROUNDS``: opening burst, a measured round, drain; with 2 the window of users in
lockstep is empty) until the estimate fits the target; what it changed is printed and in ``--json``. The estimate is checked against the measured
vanilla half of that cut-off run in tests/unit/test_demo_slo_sizing.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtier.client.slo import MIN_STEADY_ROUNDS
from kvtier.demo.calibrate import PrefillProfile

MIN_FIXED_USERS = 8
# Wall time / the model's, measured: the cut-off 2026-12-01 run's vanilla phases took 1.38x, 1.35x and
# 1.31x the model at 282 / 564 / 1128 tokens (the model counts cold prefill only: each request's 4
# decode steps and the API server's and client's share of the 2 vCPUs are not in the calibration).
WALL_FACTOR = 1.35


@dataclass(frozen=True)
class SloEstimate:
    seconds: float                       # both configurations, servers' start-up included
    per_config_s: dict[str, float]
    per_length_s: dict[str, dict[int, float]]
    visited: dict[str, dict[int, list[int]]]   # the search's users per length, as modelled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SloFit:
    size: Any                            # the SloDemoSize to run
    estimate: SloEstimate
    target_s: float
    changed: tuple[str, ...]             # what was shrunk to fit, e.g. "fixed_users 16 -> 8"
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"estimate": self.estimate.to_dict(), "target_s": self.target_s, "changed": list(self.changed),
                "fits": self.fits, "fixed_users": self.size.fixed_users,
                "warm_questions": self.size.warm_questions, "min_requests_per_user": self.size.min_requests_per_user}


def service_s(profile: PrefillProfile, size: Any, doc_tokens: int, config: str, chunk_tokens: int) -> float:
    """Predicted single-request TTFT of a measured question (side-effect free)."""
    over = size.prompt_overhead_tokens
    if config == "vanilla":
        return profile.seconds(doc_tokens + over)
    return profile.seconds(over + chunk_tokens / 2)


def documents_for(size: Any, doc_tokens: int) -> int:
    """Documents per length: the same document-set tokens at every length, at least 2."""
    return max(2, round(size.doc_set_tokens / doc_tokens))


def point_requests(size: Any, users: int) -> int:
    """Measured requests at one concurrency point: enough for every user to send several."""
    return max(size.min_requests, size.min_requests_per_user * users)


def point_seconds(profile: PrefillProfile, service: float, users: int, requests: int) -> tuple[float, float]:
    """(predicted p90 TTFT, wall seconds) of ``requests`` requests at ``users`` closed-loop users."""
    a = min(max(profile.a, 0.0), service)
    batch = a + users * (service - a)
    return batch, batch * requests / users


def estimate_slo_run(size: Any, doc_tokens: tuple[int, ...], slo_s: float, profile: PrefillProfile,
                     startup_s: float, chunk_tokens: int) -> SloEstimate:
    """Wall time of the whole demo for ``size`` on the machine ``profile`` describes (side-effect free)."""
    from kvtier.client.slo import SloOptions, search

    opts = SloOptions(slo_s=slo_s, statistic="ttft_p90_s", start=1, max_load=size.max_users, repeats=1,
                      requests_per_point=size.min_requests, steady_state=True,
                      min_requests_per_user=size.min_requests_per_user)
    per_config: dict[str, float] = {}
    per_length: dict[str, dict[int, float]] = {}
    visited: dict[str, dict[int, list[int]]] = {}
    for config in ("vanilla", "kvtier-ram-ssd"):
        total = startup_s
        per_length[config], visited[config] = {}, {}
        for n in doc_tokens:
            s = service_s(profile, size, n, config, chunk_tokens)
            cold = profile.seconds(n + size.prompt_overhead_tokens)
            docs = documents_for(size, n)
            warm = docs * size.warm_questions
            mix = (docs * cold + (warm - docs) * s) / warm        # first question per document cold
            t = point_seconds(profile, mix, 2, warm)[1]           # the warm-up runs 2 users
            users: list[int] = []

            def evaluate(load: float, repeat: int, s: float = s, users: list[int] = users):
                users.append(int(load))
                return {"ttft_p90_s": point_seconds(profile, s, int(load), 1)[0]}, []

            search(evaluate, "closed", opts)
            for u in users:
                t += size.repeats * point_seconds(profile, s, u, point_requests(size, u))[1]
            t += size.repeats * point_seconds(profile, s, size.fixed_users, point_requests(size, size.fixed_users))[1]
            per_length[config][n], visited[config][n] = t, users
            total += t
        per_config[config] = startup_s + WALL_FACTOR * (total - startup_s)
        per_length[config] = {n: WALL_FACTOR * t for n, t in per_length[config].items()}
    return SloEstimate(seconds=sum(per_config.values()), per_config_s=per_config, per_length_s=per_length,
                       visited=visited)


def fit_slo_size(size: Any, doc_tokens: tuple[int, ...], slo_s: float, profile: PrefillProfile,
                 startup_s: float, chunk_tokens: int, target_s: float) -> SloFit:
    """The largest size, shrinking only what the module doc lists, whose estimate fits ``target_s``."""
    def est(s: Any) -> SloEstimate:
        return estimate_slo_run(s, doc_tokens, slo_s, profile, startup_s, chunk_tokens)

    cur, e, changed = size, est(size), []
    steps = []
    u = size.fixed_users
    while u // 2 >= MIN_FIXED_USERS:
        u //= 2
        steps.append(("fixed_users", u))
    steps += [("warm_questions", w) for w in range(size.warm_questions - 1, 0, -1)]
    # never fewer requests per user than a steady-state window needs (with 2, users in lockstep leave it empty)
    steps += [("min_requests_per_user", r) for r in range(size.min_requests_per_user - 1, MIN_STEADY_ROUNDS - 1, -1)]
    for field, value in steps:
        if e.seconds <= target_s:
            break
        nxt = replace(cur, **{field: value})
        changed.append(f"{field} {getattr(cur, field)} -> {value}")
        cur, e = nxt, est(nxt)
    return SloFit(size=cur, estimate=e, target_s=target_s, changed=tuple(changed), fits=e.seconds <= target_s)


__all__ = ["MIN_FIXED_USERS", "WALL_FACTOR", "SloEstimate", "SloFit", "estimate_slo_run",
           "fit_slo_size", "point_seconds", "service_s"]
