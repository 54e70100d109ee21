"""The companion demo's history modes, its per-configuration work figures and its second load point.

* ``live`` history (the default; ``kvtier.client.history``): every turn carries the replies the
  model streamed for the conversation's earlier turns. Each reply is generated at the workload
  reply's own length (the turn's ``max_tokens``, with ``ignore_eos``), so the live prompts keep the
  workload's shape and the capacities sized from it keep their share of the working set; the
  engine's context leaves room for the longest reply the generator can write
  (``REPLY_CAP_FACTOR`` x the median). ``workload`` history is the earlier experiment: the
  workload's text, identical prompts, ``size.max_tokens`` generated per request.
* The live ideal hit rate comes from the prompts each configuration actually sent
  (``kvtier.client.live_ideal``), restricted to the compared requests.
* ``returning_turns``: the target's bound for a returning turn (turn > 0): the load time of its
  cached prefix (cached tokens x this run's mean kvtier load seconds per loaded token, from the
  connector's counters; 0 without kvtier) + the cold prefill of its new tokens alone (the
  calibration's profile at prompt - previous prompt - previous reply tokens: the new user message
  and the template around it); mean TTFT over the returning turns / mean bound.
* ``light_sizing``: the same experiment (same token-length and think-time scales) at a lighter
  load (``users``), with as many conversations per user as the main run where the time left allows
  (at least one per user), so the load-dependence of the ratios stays visible.
Side-effect free, except ``light_sizing`` which generates workloads in memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from kvtier.client.stream import ClientOptions
from kvtier.client.live_ideal import SentIdeal, sent_ideal
from kvtier.client.replay import ReplayOptions
from kvtier.demo.calibrate import Calibration
from kvtier.demo.sizing import Sizing, WorkloadFacts, estimate, scaled
from kvtier.demo.regime import regime_for

#: the companion generator caps a reply at 5x the median assistant length (``kvtier.workload.companion``)
REPLY_CAP_FACTOR = 5
#: the lighter load point's users (the earlier reference runs measured 6 and 8 users)
LIGHT_USERS = 6


def engine_size(size: Any, history: str) -> Any:
    """``size`` with ``max_tokens`` = what the engine must allow to be generated per request."""
    if history != "live":
        return size
    return dataclasses.replace(size, max_tokens=max(size.max_tokens, REPLY_CAP_FACTOR * size.assistant_tokens))


def replay_options(size: Any, history: str, bound_s: float) -> ReplayOptions:
    """Closed loop at ``size.concurrency``; workload history overrides max_tokens, live keeps each turn's own."""
    extra = () if history == "live" else (("max_tokens", size.max_tokens),)
    return ReplayOptions(mode="closed", concurrency=size.concurrency, duration_s=bound_s, history=history,
                         think_time_scale=size.think_time_scale, seed=size.seed,
                         client=ClientOptions(extra_body=extra))


def sent_ideals(runs: Sequence[Any], convs: Sequence[Any], tokenizer: Any, block_size: int,
                keys: set | None) -> dict[str, SentIdeal]:
    """Per configuration: the ideal of the prompts it sent (only ``keys`` counted when given)."""
    from kvtier.demo.fair import request_key

    out = {}
    for r in runs:
        if not r.records:
            continue
        counted = [x for x in r.records if keys is None or request_key(x) in keys]
        out[r.name] = sent_ideal(convs, r.records, tokenizer, block_size, counted=counted)
    return out


def work_figures(summary: dict[str, Any] | None) -> dict[str, Any]:
    """Throughput, compute saved and TTFT spread of one configuration (from its summary)."""
    s = summary or {}
    ok = s.get("requests_ok") or 0
    return {
        "output_tokens_per_s": s.get("output_tokens_per_s"),
        "prompt_tokens_per_request": (s.get("prompt_tokens_total") or 0) / ok if ok else None,
        "computed_tokens_per_request": s.get("computed_tokens_per_request"),
        "ttft_p10_s": s.get("ttft_p10_s"), "ttft_p90_s": s.get("ttft_p90_s"), "ttft_spread_s": s.get("ttft_spread_s"),
        "by_prompt_length": {label: {k: g.get(k) for k in ("requests", "ttft_mean_s", "ttft_p10_s", "ttft_p90_s",
                                                            "ttft_spread_s", "computed_tokens_per_request")}
                             for label, g in (s.get("by_prompt_length") or {}).items()},
    }


def returning_turns(records: Sequence[Any], summary: dict[str, Any] | None, profile: Any,
                    keys: set | None = None) -> dict[str, Any] | None:
    """Returning turns' mean TTFT against their bound (module docstring); None without such turns."""
    from kvtier.demo.fair import request_key

    kv = ((summary or {}).get("server") or {}).get("kvtier") or {}
    loaded = kv.get("kvtier_connector_loaded_tokens_total") or 0
    per_token = (kv.get("kvtier_connector_load_seconds_sum") or 0.0) / loaded if loaded else 0.0
    by_key = {request_key(r): r for r in records if r.ok}
    ttft, bound, new_tokens = [], [], []
    for (cid, k), r in by_key.items():
        prev = by_key.get((cid, k - 1))
        if k == 0 or prev is None or (keys is not None and (cid, k) not in keys):
            continue
        if r.prompt_tokens is None or prev.prompt_tokens is None or r.cached_tokens is None:
            continue
        new = max(1, r.prompt_tokens - prev.prompt_tokens - (prev.output_tokens or 0))
        ttft.append(r.ttft_s)
        bound.append(r.cached_tokens * per_token + profile.seconds(new))
        new_tokens.append(new)
    if not ttft:
        return None
    t, b = sum(ttft) / len(ttft), sum(bound) / len(bound)
    return {"requests": len(ttft), "ttft_mean_s": t, "bound_mean_s": b, "ttft_over_bound": t / b if b > 0 else None,
            "new_tokens_mean": sum(new_tokens) / len(new_tokens), "load_s_per_token": per_token}


def light_sizing(base: Any, main: Sizing, cal: Calibration, facts_of: Callable[[Any], WorkloadFacts],
                 users: int, budget_s: float, history: str = "live") -> Sizing:
    """The main run's scales at ``users`` users, conversations chosen for ``budget_s`` (3 server starts
    and 3 replays; see the module docstring). Never fewer conversations than users. Its capacities are
    read off its own curve (``kvtier.demo.regime.regime_for``), and its estimate uses them."""
    per_user = max(1.0, main.size.conversations / max(1, main.size.concurrency))
    c = max(users, round(users * per_user))
    while True:
        size = dataclasses.replace(scaled(base, main.length_scale, main.think_scale, c, main.reply_scale),
                                   concurrency=users, max_tokens=main.size.max_tokens)
        facts = facts_of(size)
        regime = regime_for(size, facts, cal.profile, history)
        total, per = estimate(cal.profile, cal.startup_s, size, facts, history, regime)
        own = total - cal.profile.elapsed_s - cal.startup_s          # no calibration, 3 starts
        if own <= budget_s or c <= users:
            return Sizing(size=size, length_scale=main.length_scale, reply_scale=main.reply_scale,
                          think_scale=main.think_scale, estimate_s=own,
                          per_config_s=per, facts=facts, target_s=budget_s, over_target=own > 1.1 * budget_s,
                          overridden=("users",), regime=regime)
        c -= 1
