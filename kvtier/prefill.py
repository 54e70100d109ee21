"""Measure this machine's cold prefill rate: the wall time of ``generate(max_tokens=1)`` on fresh prompts.

``probe(model, dtype, lengths, check)`` runs ``python -m kvtier.prefill`` in a subprocess
(its own vLLM offline engine via ``kvtier.engine.make_llm``, prefix caching off, one short warm-up
request first, then one distinct prompt per length) and returns one ``PrefillPoint`` per length,
plus, when asked, the engine's greedy continuation of a factual answer (``kvtier.model.AnswerCheck``,
the chat path of ``kvtier generate``: a wrong fact means the dtype computes garbage). ``measure_prefill`` returns the
points only. Used by ``kvtier doctor`` (1K tokens) and by anything that sizes itself to the
machine (demo calibration). The subprocess keeps vLLM's start-up noise and state out of the
caller; a failure or a timeout is a ``PrefillError`` with one line saying why. Importing this
module does not import torch or vLLM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.model import AnswerCheck

WARMUP_TOKENS = 32
ANSWER_TOKENS = 16
_RESULT = "KVTIER_PREFILL_RESULT "


class PrefillError(RuntimeError):
    """The measurement could not run (engine failed to start, timed out); one-line message."""


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class ProbeResult:
    dtype: str
    points: list[PrefillPoint] = field(default_factory=list)
    answer: str | None = None


def prompt_ids(length: int, salt: int, vocab: int = 49152) -> list[int]:
    """A deterministic prompt of ``length`` varied token ids (no repeats a prefix cache could reuse)."""
    lo, span = 100, max(1, min(vocab, 49152) - 200)
    return [lo + (salt * 104_729 + i * 7_919 + (i * i) % 997) % span for i in range(length)]


def run_in_process(model: str, dtype: str, lengths: list[int], check: AnswerCheck | None = None) -> ProbeResult:
    """Time the lengths in this process (imports vLLM; call ``apply_vllm_env`` first)."""
    from vllm import SamplingParams, TokensPrompt

    from kvtier.engine import chat_answer, make_llm

    llm = make_llm(model, dtype=dtype, max_model_len=max(lengths) + WARMUP_TOKENS + 64,
                   enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def timed(ids: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(prompt_ids(WARMUP_TOKENS, salt=0))   # first-call overheads out of the way
    points = [PrefillPoint(n, timed(prompt_ids(n, salt=i + 1))) for i, n in enumerate(lengths)]
    answer = chat_answer(llm, check.question, ANSWER_TOKENS, answer_start=check.answer_start) if check else None
    return ProbeResult(dtype, points, answer)


def parse_result(stdout: str, dtype: str = "") -> ProbeResult:
    """The result from the subprocess's stdout (its last result line); raises PrefillError."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(_RESULT)]
    if not lines:
        raise PrefillError("the prefill probe printed no result")
    try:
        raw = json.loads(lines[-1][len(_RESULT):])
        points = [PrefillPoint(int(p["tokens"]), float(p["seconds"])) for p in raw["points"]]
        return ProbeResult(str(raw.get("dtype", dtype)), points, raw.get("answer"))
    except (ValueError, KeyError, TypeError) as e:
        raise PrefillError(f"the prefill probe printed a bad result ({type(e).__name__})") from None


def probe(model: str | Path, dtype: str, lengths: list[int], check: AnswerCheck | None = None,
          timeout_s: float = 900) -> ProbeResult:
    """Cold prefill time per length (and, with ``check``, the greedy continuation of its answer) on a
    fresh engine in a subprocess."""
    from kvtier.runtime import vllm_env

    if not lengths or any(n < 1 for n in lengths):
        raise PrefillError(f"prompt lengths must be positive, got {lengths}")
    env = vllm_env(kv_cache_space_gib=1)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cmd = [sys.executable, "-m", "kvtier.prefill", str(model), dtype, ",".join(map(str, lengths))]
    if check:
        cmd += [check.question, check.answer_start]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PrefillError(f"the prefill probe did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        errs = [ln for ln in proc.stderr.splitlines() if "Error" in ln] or proc.stderr.splitlines() or ["no output"]
        raise PrefillError(f"the prefill probe exited {proc.returncode}: {errs[-1].strip()[:300]}")
    return parse_result(proc.stdout, dtype)


def measure_prefill(model: str | Path, dtype: str, lengths: list[int], timeout_s: float = 900) -> list[PrefillPoint]:
    """Cold prefill time per length, on a fresh engine in a subprocess; raises PrefillError."""
    return probe(model, dtype, lengths, timeout_s=timeout_s).points


def _main(argv: list[str]) -> int:
    model, dtype, lengths = argv[0], argv[1], [int(x) for x in argv[2].split(",")]
    check = AnswerCheck(argv[3], argv[4], "") if len(argv) > 4 else None
    result = run_in_process(model, dtype, lengths, check)
    print(_RESULT + json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
