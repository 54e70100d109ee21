"""The records of a ``kvtier bench ttft`` run: one ``TtftRow`` per prompt length, the
``TtftReport`` around them, and the check that every hit row loaded what its label claims.
Plain data; ``ttft`` fills them, ``ttft_report`` renders them."""

from __future__ import annotations

from dataclasses import dataclass, field

#: the engine's token budget per step (``--max-num-batched-tokens``) unless the run names one
MAX_BATCHED = 2048


@dataclass
class TtftRow:
    prompt_tokens: int
    vanilla_s: float | None = None
    apc_hit_s: float | None = None
    kvtier_miss_s: float | None = None
    kvtier_ram_s: float | None = None
    kvtier_ssd_s: float | None = None
    example_connector_s: float | None = None
    example_connector_error: str | None = None
    hit_tokens: int | None = None           # tokens a full hit loads (ttft_check.expected_hit_tokens)
    kv_bytes: int | None = None
    ideal_read_s: float | None = None       # best raw read of the same chunk files (rawread)
    ideal_ssd_s: float | None = None
    miss_overhead_ratio: float | None = None
    ssd_vs_ideal: float | None = None
    ideal_not_a_bound: bool = False         # kvtier SSD beat the "ideal": the ideal was wrong
    speedup_vs_example: float | None = None
    peers_hit_s: dict = field(default_factory=dict)   # other connectors that ran: hit TTFT
    shared_hit_s: dict = field(default_factory=dict)  # shared backend -> hit TTFT in a fresh engine, empty local tiers
    repeats: int | None = None


@dataclass
class TtftReport:
    command: str
    machine: dict
    model: str
    dtype: str
    repeats: dict
    raw_read: dict | None                   # how the ideal was measured (in flight, O_DIRECT, bytes/s)
    max_num_batched_tokens: int = MAX_BATCHED
    block_size: int | None = None
    chunk_size: int | None = None
    rows: list[TtftRow] = field(default_factory=list)
    crashes: dict = field(default_factory=dict)       # role -> the error line (peers that cannot run here)
    violations: list[str] = field(default_factory=list)   # rows that did not load what they claim
    kvtier_config: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)      # CPU used by other processes during the run
    shared_seed: dict = field(default_factory=dict)   # backend -> how its chunks were put there (shared_seed)
    shared_targets: dict = field(default_factory=dict)  # backend -> reader's config kind/where (no secrets)
    diag: dict = field(default_factory=dict)      # role -> --diag samples (profiled hits), not in the rows
    resumed_roles: list = field(default_factory=list)   # roles whose results came from an earlier invocation


class TtftCheckFailed(RuntimeError):
    """A hit row could not prove that it loaded what its label claims."""


def check_report(report: TtftReport) -> None:
    """Raise ``TtftCheckFailed`` if any hit row did not load what it claims."""
    if report.violations:
        raise TtftCheckFailed("hit rows that did not load what they claim:\n  " + "\n  ".join(report.violations))
