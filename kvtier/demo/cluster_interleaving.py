"""The cluster demo's companion interleaving, chosen so that plain vLLM sits in the published regime.

What decides vanilla vLLM's hit rate on a replica is its own KV space against the **reuse
distances** on that replica: the distinct tokens the replica's other requests touch between two
visits of a conversation's prefix (``kvtier.demo.regime``). Each replica's KV space is at its floor
(one full-length request and a block: vLLM refuses less), so only the interleaving can put the floor
at the curve's low point: with U users in a closed loop a conversation comes back after about U - 1
other turns, about (U - 1) / N of them on each of N replicas under round-robin, each touching its
own whole history. Conversations run out one by one at the end of a run; with more conversations
than users (``CONVERSATIONS_PER_USER``) a user takes the next one, so U stay in flight longer.

``choose_interleaving`` tries, for each token-length scale g (``LENGTH_SCALES``, largest first:
system prompt, messages and the prompt cap x g) and each number of users U (``USER_STEPS`` x the
base size's users, fewest first), the workload with ``CONVERSATIONS_PER_USER`` x U conversations,
plans it (``kvtier.demo.cluster_sizing.plan_for_size``: per-replica curves in the closed loop's send
order, capacities, per-run time estimates) and takes the first whose vanilla engine is predicted at
most ``VANILLA_TARGET`` on every replica's round-robin curve and whose estimate is within
``OVER_TARGET`` x the target. What gives is token lengths and request counts, never the regime: when
no size fits the target, the reaching sizes (at each scale the fewest users) are tried and the one
with the smallest estimate is taken, and ``over_target_s``
says by how much it does not fit; when no size reaches the regime, the one with the lowest vanilla
prediction, said in ``problem``. Side-effect free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from kvtier.demo.cluster_sizing import (DEFAULT_STARTUP_S, VANILLA_BOUND, VANILLA_TARGET, ClusterPlan,
                                        plan_for_size)
from kvtier.demo.sizing import OVER_TARGET   # an estimate within this x the target fits it (the companion demo's rule)

USER_STEPS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
CONVERSATIONS_PER_USER = (1.5, 2.0)     # tried in turn: the seeded workloads of neighbouring sizes differ
LENGTH_SCALES = (1.0, 0.8, 0.65, 0.5)
MIN_MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class Candidate:
    """One interleaving tried: its size, vanilla's predicted round-robin hit rate (worst replica and
    the cluster's), the estimate, and whether it reached the regime / fitted the target."""

    length_scale: float
    users: int
    conversations: int
    requests: int
    vanilla_rr_worst_replica: float
    vanilla_rr: float
    estimate_s: float
    reached: bool
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Interleaving:
    """The chosen plan, the candidate it came from, and every candidate tried (in order)."""

    plan: ClusterPlan
    chosen: Candidate
    target_s: float
    tried: tuple[Candidate, ...]

    @property
    def over_target_s(self) -> float:
        """Seconds the estimate is over the target (0 when within ``OVER_TARGET`` x it)."""
        return 0.0 if self.chosen.fits else self.chosen.estimate_s - self.target_s

    @property
    def problem(self) -> str | None:
        """Why this is not the published regime within the target, in one line; None when it is."""
        c = self.chosen
        if not c.reached:
            return (f"no interleaving tried puts vLLM's own KV space at <= {VANILLA_TARGET:.0%} predicted hit rate "
                    f"(<= {VANILLA_BOUND:.0%} on every replica): the lowest is {c.vanilla_rr:.1%} "
                    f"({c.vanilla_rr_worst_replica:.1%} on the worst replica; {c.users} users, "
                    f"{c.conversations} conversations)")
        if not c.fits:
            return (f"the regime needs {c.users} users and {c.conversations} conversations at token-length scale "
                    f"{c.length_scale:g}: estimated {c.estimate_s / 60:.1f} min, {self.over_target_s / 60:.1f} min over "
                    f"the {self.target_s / 60:.0f}-minute target on this machine")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"target_s": self.target_s, "vanilla_target": VANILLA_TARGET, "vanilla_bound": VANILLA_BOUND,
                "length_scale": self.chosen.length_scale, "users": self.chosen.users,
                "conversations": self.chosen.conversations, "reached": self.chosen.reached,
                "estimate_s": self.chosen.estimate_s, "over_target_s": self.over_target_s, "problem": self.problem,
                "tried": [c.to_dict() for c in self.tried]}


def candidate_size(base: Any, length_scale: float, users: int, per_user: float = CONVERSATIONS_PER_USER[0]) -> Any:
    """``base`` with token lengths x ``length_scale``, ``users`` users and ``per_user`` x as many
    conversations (personas in the base size's proportion)."""
    g = length_scale
    convs = max(users, round(per_user * users))
    personas = max(1, min(convs, round(convs * base.personas / base.conversations)))
    return dataclasses.replace(
        base, conversations=convs, concurrency=users, personas=personas,
        system_tokens=max(16, round(base.system_tokens * g)), user_tokens=max(4, round(base.user_tokens * g)),
        assistant_tokens=max(4, round(base.assistant_tokens * g)),
        max_prompt_tokens=max(MIN_MAX_PROMPT_TOKENS, round(base.max_prompt_tokens * g)))


def user_steps(base_users: int) -> list[int]:
    out: list[int] = []
    for f in USER_STEPS:
        u = max(1, round(base_users * f))
        if u not in out:
            out.append(u)
    return out


def choose_interleaving(base: Any, replicas: int, tokenizer: Any, profile: Any, kv_bytes_per_token: int,
                        history: str = "live", *, runs: Sequence[tuple[str, str]],
                        startup_s: float = DEFAULT_STARTUP_S, calibration_s: float = 0.0,
                        target_s: float | None = None) -> Interleaving:
    """The interleaving of the companion workload (module docstring); ``base`` a
    ``kvtier.demo.companion.CompanionDemoSize`` (its ``target_s`` unless ``target_s`` is given)."""
    from kvtier.demo.companion import _spec
    from kvtier.workload.companion import generate_companion

    target = float(target_s if target_s is not None else base.target_s)
    tried: list[tuple[Candidate, ClusterPlan]] = []
    attempted: set[tuple[float, int]] = set()

    def attempt(g: float, users: int) -> tuple[Candidate, ClusterPlan]:
        """The first conversation count per user that reaches the regime, else the lowest prediction."""
        attempted.add((g, users))
        outs = []
        for per_user in CONVERSATIONS_PER_USER:
            outs.append(one(g, users, per_user))
            if outs[-1][0].reached:
                return outs[-1]
        return min(outs, key=lambda x: x[0].vanilla_rr)

    def one(g: float, users: int, per_user: float) -> tuple[Candidate, ClusterPlan]:
        size = candidate_size(base, g, users, per_user)
        header, convs = generate_companion(_spec(size))
        plan = plan_for_size("companion", size, header, convs, replicas, tokenizer, profile, kv_bytes_per_token,
                             history)
        worst = max(plan.predicted_per_replica["vanilla/roundrobin"])
        cluster = plan.predicted["vanilla/roundrobin"]
        est = plan.estimate_s(runs, startup_s, calibration_s)
        cand = Candidate(g, users, size.conversations, plan.facts.requests, worst, cluster, est,
                         cluster <= VANILLA_TARGET + 1e-12 and worst <= VANILLA_BOUND + 1e-12,
                         est <= OVER_TARGET * target)
        tried.append((cand, plan))
        return cand, plan

    chosen = None
    for g in LENGTH_SCALES:
        for users in user_steps(base.concurrency):
            cand, plan = attempt(g, users)
            if cand.reached and cand.fits:
                chosen = (cand, plan)
                break
            if cand.reached or all(not c.fits for c, _ in tried[-len(CONVERSATIONS_PER_USER):]):
                break           # more users only add time: the next, shorter token lengths
        if chosen is not None:
            break
    if chosen is None:                 # over the target: at each length scale, the fewest users reaching it
        for g in LENGTH_SCALES:
            for users in user_steps(base.concurrency):
                done = [c for c, _ in tried if (c.length_scale, c.users) == (g, users)]
                if any(c.reached for c in done) or ((g, users) not in attempted and attempt(g, users)[0].reached):
                    break
        reached = [x for x in tried if x[0].reached]
        chosen = (min(reached, key=lambda x: x[0].estimate_s) if reached
                  else min(tried, key=lambda x: (x[0].vanilla_rr, x[0].estimate_s)))
    cand, plan = chosen
    result = Interleaving(plan=plan, chosen=cand, target_s=target, tried=tuple(c for c, _ in tried))
    return dataclasses.replace(result, plan=dataclasses.replace(plan, sizing=result.to_dict()))
