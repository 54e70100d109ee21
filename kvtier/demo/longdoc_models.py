"""Which bundled model ``kvtier demo longdoc`` runs (``--model``), and how each is sized.

- ``smollm2`` (the default): three ~7.6K-token documents, the model's 8K context (``longdoc.DEFAULT``).
- ``gemma3`` (gemma-3-270m, 32K context, 5 sliding-window layers of 512 tokens per global layer):
  three ~22K-token documents, the published regime (13x lower TTFT on >20K-token documents). The
  three cold prefills are the demo's cost: 82-102 s each in bfloat16 on the AVX-512 + bf16 class
  (2 vCPU; the run with a JuiceFS column took 9.7 min), an estimated 3.4-5.6 min each in float32 on
  the AVX2 class (17-23 min in all; docs/results.md, "Long documents"). ``request_timeout_s`` leaves a
  cold prefill 30 minutes. ``--quick`` runs one ~4K-token document.

``tier_sizes`` gives the RAM and SSD tiers room for every document: kvtier stores every part of every
chunk (all 18 of gemma's layers, sliding-window layers included: 36,864 B/token in float32), so a
hit read back from either tier finds the whole document. Side-effect free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.demo.common import DEMO_CHUNK_TOKENS, DemoError, ModelFacts
from kvtier.demo.longdoc import DEFAULT, QUICK, LongDocDemoSize

#: Tokens of the server's context beyond the longest prompt (the demo's ``max_model_len`` margin).
CONTEXT_MARGIN = 64
#: The tiers' floors: what the demo has always configured (the default model's documents fit them).
MIN_MEMORY_BYTES = 2 * 2**30
MIN_DISK_BYTES = 8 * 2**30
#: Room above the documents' KV in each tier (chunk headers, the warm-up request, slot rounding).
HEADROOM = 1.25
_STEP = 256 * 2**20


@dataclass(frozen=True)
class LongDocModel:
    """One model the long-document demo runs: the bundled model's name and its two sizes."""

    name: str
    default: LongDocDemoSize
    quick: LongDocDemoSize
    description: str

    def size(self, quick: bool) -> LongDocDemoSize:
        return self.quick if quick else self.default


GEMMA3_DEFAULT = LongDocDemoSize(documents=3, doc_tokens=22000, max_prompt_length=22528, request_timeout_s=1800.0)
GEMMA3_QUICK = LongDocDemoSize(documents=1, doc_tokens=3800, max_prompt_length=4000, request_timeout_s=600.0)

LONGDOC_MODELS: dict[str, LongDocModel] = {
    "smollm2": LongDocModel("smollm2", DEFAULT, QUICK, "SmolLM2-135M, ~7.6K-token documents (8K context)"),
    "gemma3": LongDocModel("gemma3", GEMMA3_DEFAULT, GEMMA3_QUICK,
                           "gemma-3-270m, ~22K-token documents (32K context; the published >20K regime)"),
}
DEFAULT_MODEL = "smollm2"


def longdoc_model(name: str) -> LongDocModel:
    """The long-document sizing of bundled model ``name``; a one-line ``DemoError`` naming the choices."""
    try:
        return LONGDOC_MODELS[name.strip().lower()]
    except KeyError:
        raise DemoError(f"unknown model {name!r} for the long-document demo; choose from "
                        f"{', '.join(LONGDOC_MODELS)}") from None


def check_fits(size: LongDocDemoSize, facts: ModelFacts) -> None:
    """A one-line ``DemoError`` unless the longest prompt (plus the margin) fits the model's context."""
    need = size.max_prompt_length + CONTEXT_MARGIN
    if need > facts.max_model_len:
        raise DemoError(f"{size.max_prompt_length}-token prompts do not fit {facts.path.name}'s "
                        f"{facts.max_model_len}-token context ({CONTEXT_MARGIN} tokens of margin)")
    if size.doc_tokens >= size.max_prompt_length:
        raise DemoError(f"documents of {size.doc_tokens} tokens leave no room for the question in "
                        f"{size.max_prompt_length}-token prompts")


@dataclass(frozen=True)
class TierSizes:
    """Bytes of kvtier's RAM and SSD tiers in every demo server, and the documents' KV they hold."""

    memory_bytes: int
    disk_bytes: int
    documents_bytes: int


def tier_sizes(size: LongDocDemoSize, facts: ModelFacts) -> TierSizes:
    """RAM and SSD tiers that hold every document's KV (every chunk of the longest prompt, all layers),
    with ``HEADROOM``, rounded up to 256 MiB; never below the floors (the default model's sizes)."""
    chunks = math.ceil(size.max_prompt_length / DEMO_CHUNK_TOKENS)
    need = size.documents * facts.kv_bytes(chunks * DEMO_CHUNK_TOKENS)
    room = math.ceil(need * HEADROOM / _STEP) * _STEP
    return TierSizes(max(MIN_MEMORY_BYTES, room), max(MIN_DISK_BYTES, 2 * room), need)
