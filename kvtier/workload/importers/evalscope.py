"""evalscope's local perf datasets -> single-turn kvtier conversations.

evalscope (``evalscope perf --dataset ... --dataset-path FILE``) reads two local formats that
long-context TTFT studies use:

* ``openqa``     JSON Lines, one object per line with a ``question`` string (other keys ignored)
* ``longalpaca`` a JSON array of objects with an ``instruction`` string (LongAlpaca-12k: the long
  document and the question in one field; ``output`` is the reference answer)

``format="auto"`` picks by the first item's keys. Each item becomes one conversation with one
user turn; ``max_tokens`` = the reference answer's approx tokens (``answer``/``output``/
``response``, chars/4) clipped to ``max_output_tokens``, or ``max_output_tokens`` without one.
Items whose prompt is longer than ``max_prompt_tokens`` (approx) are skipped and counted, like
evalscope's ``--max-prompt-length``; shorter than ``min_prompt_tokens`` likewise. Arrivals:
Poisson at ``rate`` conversations/s (seeded).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.workload.format import Conversation, Turn, WorkloadError, WorkloadHeader
from kvtier.workload.importers.jsonread import ReadReport, iter_json_items
from kvtier.workload.tokens import approx_token_count

FIELDS = {"openqa": "question", "longalpaca": "instruction"}
_ANSWER_KEYS = ("answer", "output", "response")


@dataclass(frozen=True)
class EvalscopeOptions:
    format: Literal["auto", "openqa", "longalpaca"] = "auto"
    max_conversations: int | None = None
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None
    max_output_tokens: int = 512
    rate: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class EvalscopeReport:
    kind: str
    items: int
    skipped_length: int
    truncated: bool


def _kind(p: Path, label: str, item: Any, requested: str) -> str:
    if requested != "auto":
        return requested
    if isinstance(item, dict):
        for kind, key in FIELDS.items():
            if key in item:
                return kind
    raise WorkloadError(f"{p}: {label}: neither a 'question' (openqa) nor an 'instruction' (longalpaca) "
                        "field: pass --format if this is an evalscope dataset")


def import_evalscope(path: str | Path, opts: EvalscopeOptions) -> tuple[WorkloadHeader, list[Conversation],
                                                                         EvalscopeReport]:
    """Read an evalscope local dataset file (see the module doc); raises ``WorkloadError``."""
    p = Path(path)
    rng = random.Random(opts.seed)
    report = ReadReport()
    kind: str | None = None
    out: list[Conversation] = []
    skipped = 0
    t = 0.0
    for label, item in iter_json_items(p, report):
        kind = kind or _kind(p, label, item, opts.format)
        key = FIELDS[kind]
        if not isinstance(item, dict) or not isinstance(item.get(key), str):
            raise WorkloadError(f"{p}: {label}: expected an object with a {key!r} string ({kind} format)")
        text = item[key]
        n = approx_token_count(text)
        if n < opts.min_prompt_tokens or (opts.max_prompt_tokens is not None and n > opts.max_prompt_tokens):
            skipped += 1
            continue
        if not text.strip():
            raise WorkloadError(f"{p}: {label}: the {key!r} field is empty")
        answer = next((item[k] for k in _ANSWER_KEYS if isinstance(item.get(k), str)), None)
        max_tokens = opts.max_output_tokens if answer is None else \
            max(1, min(opts.max_output_tokens, approx_token_count(answer) or opts.max_output_tokens))
        arrival = t + (rng.expovariate(opts.rate) if out else 0.0)
        cid = str(item.get("id", f"{kind}{len(out):06d}"))
        out.append(Conversation(id=cid, arrival_s=round(arrival, 3), turns=[Turn(user=text, max_tokens=max_tokens)],
                                metadata={"source": f"evalscope-{kind}", "category": kind}))
        t = arrival
        if opts.max_conversations is not None and len(out) >= opts.max_conversations:
            break
    if report.truncated:
        print(f"warning: {p} is truncated; kept the {report.items} complete items before the cut", file=sys.stderr)
    if not out:
        why = f" ({skipped} outside the prompt-length limits)" if skipped else ""
        raise WorkloadError(f"{p}: no usable item found{why}")
    header = WorkloadHeader(name=f"evalscope-{kind}", description=f"imported from {p.name}",
                            generator={"kind": f"import-evalscope-{kind}", "source": str(p), **opts.__dict__})
    return header, out, EvalscopeReport(kind or "?", report.items, skipped, report.truncated)
