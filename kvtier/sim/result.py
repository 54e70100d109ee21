"""What one simulated engine produced over a trace: per-request arrays and run counters
(``EngineSim.run``; summarised by ``kvtier.sim.summary``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SimResult:
    """Per-request arrays (index = request index in the trace); ``sent`` False = never issued."""
    sent: np.ndarray
    ok: np.ndarray
    send_s: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    cached_tokens: np.ndarray
    tier_tokens: dict[str, np.ndarray]     # gpu, ram, ssd, shared
    load_s: np.ndarray
    output_tokens: np.ndarray
    duration_s: float
    steps: int
    counters: dict[str, int]
