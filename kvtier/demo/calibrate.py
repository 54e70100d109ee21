"""Calibration: how fast this machine prefills, so the demos can size themselves to it.

``measure_profile(time_prefill, lengths)`` times a cold prefill (nothing cached, 1 output token)
at 2-3 prompt lengths and fits ``t(n) = a + b n + c n^2`` (all >= 0); ``time_decode`` (optional)
adds the seconds of one decode step with 1 and with ``DECODE_BATCH`` requests decoding together
(the estimate of a live-history chat needs them: its replies are tens of tokens). The timing function is
injected: ``server_prefill_timer`` sends token-id prompts to a launched vLLM server (prefix caching
off); unit tests pass a fake. Measuring stops early when the next length would overrun the
budget (at least two lengths are always measured).

The demos then scale their workload with ``speed_factor``: this machine's 1K-token cold prefill
over the reference machine's (``REFERENCE_PREFILL_1K_S``, where the demos' defaults were tuned).

Side-effect free except for the requests the timing function sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

#: Cold prefill of 1,024 tokens on the machine the demos' default sizes were tuned on (AVX-512 with
#: native bf16, one engine core). The defaults took ~15 min there.
REFERENCE_PREFILL_1K_S = 1.6

#: Prompt lengths measured by default (short: the calibration must stay around a minute on slow CPUs).
DEFAULT_LENGTHS = (256, 512, 1024)
#: decode steps are timed with 1 and with this many requests decoding at once ...
DECODE_BATCH = 4
#: ... each generating this many tokens after a short cold prompt
DECODE_TOKENS = 33
DECODE_PROMPT_TOKENS = 64

TimePrefill = Callable[[int], float]
#: ``time_decode(n)``: seconds per decode step while ``n`` requests decode together
TimeDecode = Callable[[int], float]


class CalibrationError(RuntimeError):
    """The machine could not be timed (server failed a request, or nonsense timings)."""


@dataclass(frozen=True)
class PrefillProfile:
    """Cold prefill seconds at measured prompt lengths and the fitted ``a + b n + c n^2``."""

    points: tuple[tuple[int, float], ...]
    a: float
    b: float
    c: float
    elapsed_s: float = 0.0
    #: (requests decoding together, seconds per decode step); empty: not measured (older files)
    decode_points: tuple[tuple[int, float], ...] = ()

    def decode_step_s(self, batch: float) -> float:
        """Seconds of one decode step with ``batch`` requests decoding together: the line through the
        measured points (flat with one point, 0 when none were measured). Side-effect free."""
        pts = sorted(self.decode_points)
        if not pts:
            return 0.0
        (n0, t0), (n1, t1) = pts[0], pts[-1]
        if n1 == n0:
            return t0
        slope = max(0.0, (t1 - t0) / (n1 - n0))
        return t0 + slope * max(0.0, float(batch) - n0)

    def seconds(self, tokens: float) -> float:
        """Predicted cold prefill time of a ``tokens``-long prompt."""
        n = max(0.0, float(tokens))
        return self.a + self.b * n + self.c * n * n

    def extend_seconds(self, context: float, new: float) -> float:
        """Predicted time to prefill ``new`` tokens after ``context`` cached ones (no fixed cost a)."""
        ctx, new = max(0.0, context), max(0.0, new)
        return self.b * new + self.c * ((ctx + new) ** 2 - ctx ** 2)

    def tokens_for(self, seconds: float) -> int:
        """The longest prompt whose predicted cold prefill is <= ``seconds`` (0 if none)."""
        lo, hi = 0, 1
        while self.seconds(hi) <= seconds and hi < 1 << 24:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.seconds(mid) <= seconds else (lo, mid)
        return lo if self.seconds(lo) <= seconds else 0

    def speed_factor(self) -> float:
        """This machine's 1K-token cold prefill / the reference machine's (> 1: slower)."""
        return self.seconds(1024) / REFERENCE_PREFILL_1K_S

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_1k_s": self.seconds(1024), "speed_factor": self.speed_factor(),
                "decode_step_1_s": self.decode_step_s(1), f"decode_step_{DECODE_BATCH}_s": self.decode_step_s(DECODE_BATCH),
                "reference_prefill_1k_s": REFERENCE_PREFILL_1K_S}


def fit_profile(points: Sequence[tuple[int, float]], elapsed_s: float = 0.0) -> PrefillProfile:
    """Least-squares ``a + b n + c n^2`` with non-negative coefficients (linear when 2 points,
    or when the quadratic term would be negative); raises CalibrationError on nonsense."""
    pts = sorted((int(n), float(t)) for n, t in points)
    if len({n for n, _ in pts}) < 2:
        raise CalibrationError("calibration needs cold prefill times at two or more prompt lengths")
    if any(t <= 0 for _, t in pts):
        raise CalibrationError(f"calibration measured a non-positive prefill time: {pts}")
    best: tuple[float, float, float] | None = None
    if len(pts) >= 3:
        best = _lstsq(pts, quadratic=True)
        if best is not None and (best[1] < 0 or best[2] < 0):
            best = None
    if best is None:
        best = _lstsq(pts, quadratic=False)
    a, b, c = best or (0.0, 0.0, 0.0)
    if b < 0 or (b == 0 and c == 0):
        raise CalibrationError(f"prefill time does not grow with prompt length: {pts}")
    if a < 0:   # through the origin: refit the slope alone
        a, b = 0.0, sum(n * t for n, t in pts) / sum(n * n for n, _ in pts)
    return PrefillProfile(points=tuple(pts), a=a, b=b, c=c, elapsed_s=elapsed_s)


def _lstsq(pts: Sequence[tuple[int, float]], quadratic: bool) -> tuple[float, float, float] | None:
    """Normal equations in scaled units (n / 1000) to keep them well conditioned."""
    cols = 3 if quadratic else 2
    rows = [[1.0, n / 1000, (n / 1000) ** 2][:cols] for n, _ in pts]
    ys = [t for _, t in pts]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(cols)] for i in range(cols)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(cols)]
    sol = _solve(ata, aty)
    if sol is None:
        return None
    a, b = sol[0], sol[1] / 1000
    c = sol[2] / 1e6 if quadratic else 0.0
    return a, b, c


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    n = len(v)
    aug = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(aug[r][col]))
        if abs(aug[piv][col]) < 1e-12:
            return None
        aug[col], aug[piv] = aug[piv], aug[col]
        for r in range(n):
            if r != col:
                f = aug[r][col] / aug[col][col]
                aug[r] = [x - f * y for x, y in zip(aug[r], aug[col])]
    return [aug[i][n] / aug[i][i] for i in range(n)]


def measure_profile(time_prefill: TimePrefill, lengths: Sequence[int] = DEFAULT_LENGTHS, *,
                    budget_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                    on_point: Callable[[int, float], None] = lambda n, t: None,
                    time_decode: TimeDecode | None = None) -> PrefillProfile:
    """Time ``time_prefill(n)`` for ascending ``lengths``; skip a length predicted to overrun the budget.

    The first call is a warm-up (not recorded: the first request of a fresh server pays one-off
    costs). At least two lengths are always measured. With ``time_decode``, the decode step is then
    timed with 1 and ``DECODE_BATCH`` requests (a few seconds on the slow machines).
    """
    lens = sorted(set(int(n) for n in lengths))
    if len(lens) < 2 or lens[0] < 1:
        raise CalibrationError("calibration needs at least two positive prompt lengths")
    t0 = clock()
    time_prefill(min(64, lens[0]))          # warm-up
    points: list[tuple[int, float]] = []
    for n in lens:
        if len(points) >= 2:
            predicted = fit_profile(points).seconds(n)
            if clock() - t0 + predicted > budget_s:
                break
        t = time_prefill(n)
        points.append((n, t))
        on_point(n, t)
    decode: tuple[tuple[int, float], ...] = ()
    if time_decode is not None:
        decode = tuple((b, time_decode(b)) for b in (1, DECODE_BATCH))
        if any(t <= 0 for _, t in decode):
            raise CalibrationError(f"calibration measured a non-positive decode step: {decode}")
    return dataclasses.replace(fit_profile(points, elapsed_s=clock() - t0), decode_points=decode)


def random_prompt(tokens: int, seed: int, vocab: tuple[int, int] = (1000, 30000)) -> list[int]:
    """A prompt of ``tokens`` random token ids (distinct per seed: nothing is shared between prompts)."""
    rng = random.Random(seed)
    return [rng.randrange(*vocab) for _ in range(tokens)]


def _replay_fresh(url: str, prompts: Sequence[tuple[str, list[int]]], max_tokens: int, request_timeout_s: float,
                  what: str) -> list[Any]:
    """Send ``prompts`` ((id, token ids) each) at once, closed loop, and return their records;
    CalibrationError naming ``what`` when the replay or any request failed."""
    from kvtier.client.stream import ClientOptions
    from kvtier.client.replay import ReplayError, ReplayOptions, replay_conversations
    from kvtier.workload.format import Conversation, Turn

    convs = [Conversation(id=cid, turns=[Turn(prompt_token_ids=ids, max_tokens=max_tokens)]) for cid, ids in prompts]
    opts = ReplayOptions(mode="closed", concurrency=len(convs), progress=False,
                         client=ClientOptions(request_timeout_s=request_timeout_s))
    try:
        recs = asyncio.run(replay_conversations(convs, url, opts)).records
    except ReplayError as e:
        raise CalibrationError(f"{what} failed: {e}") from None
    for rec in recs:
        if rec.error_kind or rec.ttft_s is None:
            raise CalibrationError(f"{what} failed: {rec.error_kind}: {rec.error}")
    return recs


def server_prefill_timer(url: str, request_timeout_s: float = 600.0) -> TimePrefill:
    """A timing function: TTFT of a fresh random token-id prompt on the server at ``url``
    (1 output token, streaming client). Start the server with prefix caching off."""
    calls = {"n": 0}

    def time_prefill(tokens: int) -> float:
        calls["n"] += 1
        rec, = _replay_fresh(url, [(f"calibrate-{calls['n']}", random_prompt(tokens, seed=calls["n"]))], 1,
                             request_timeout_s, f"calibration request of {tokens} tokens")
        return rec.ttft_s

    return time_prefill


def server_decode_timer(url: str, request_timeout_s: float = 600.0) -> TimeDecode:
    """A timing function: seconds per decode step while ``n`` fresh requests (``DECODE_PROMPT_TOKENS``
    random token ids each, ``DECODE_TOKENS`` generated: the client sends ``ignore_eos``) decode at once; the mean
    over the requests of (e2e - TTFT) / (tokens - 1)."""
    calls = {"n": 0}

    def time_decode(n: int) -> float:
        prompts = []
        for _ in range(n):
            calls["n"] += 1
            prompts.append((f"calibrate-decode-{calls['n']}",
                            random_prompt(DECODE_PROMPT_TOKENS, seed=10_000 + calls["n"])))
        recs = _replay_fresh(url, prompts, DECODE_TOKENS, request_timeout_s,
                             f"calibration decode requests ({n} at once)")
        steps = []
        for rec in recs:
            if rec.e2e_s is None or not rec.output_tokens:
                raise CalibrationError(f"calibration decode request {rec.conversation_id} has no e2e time or tokens")
            if rec.output_tokens > 1:
                steps.append((rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1))
        if not steps:
            raise CalibrationError("calibration decode requests generated one token each")
        return sum(steps) / len(steps)

    return time_decode


@dataclass(frozen=True)
class Calibration:
    """What the demos size themselves from: the prefill profile and a server's start-up time."""

    profile: PrefillProfile
    startup_s: float
    dtype: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.to_dict(), "startup_s": self.startup_s, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        p = d["profile"]
        return cls(profile=PrefillProfile(points=tuple((int(n), float(t)) for n, t in p["points"]), a=float(p["a"]),
                                          b=float(p["b"]), c=float(p["c"]), elapsed_s=float(p.get("elapsed_s", 0.0)),
                                          decode_points=tuple((int(n), float(t)) for n, t in p.get("decode_points", ()))),
                   startup_s=float(d["startup_s"]), dtype=d.get("dtype"))


def load_calibration(path: Path, dtype: str | None) -> Calibration:
    """A calibration saved by an earlier run (``calibration.json``, or a demo JSON with a
    ``calibration`` key); CalibrationError with one line when unreadable or for another dtype."""
    import json

    try:
        data = json.loads(Path(path).read_text())
        cal = Calibration.from_dict(data.get("calibration", data))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"cannot read a calibration from {path}: {type(e).__name__}: {e}") from None
    if dtype is not None and cal.dtype is not None and cal.dtype != dtype:
        raise CalibrationError(f"{path} was measured with dtype {cal.dtype}, this run uses {dtype}")
    return cal


def calibrate_on_server(model: str, dtype: str | None, log_path, *, lengths: Sequence[int] = DEFAULT_LENGTHS,
                        budget_s: float = 60.0, start_server: Callable[..., Any] | None = None,
                        on_point: Callable[[int, float], None] = lambda n, t: None) -> Calibration:
    """Start a plain vLLM server (prefix caching off, ``dtype``), time cold prefills, stop it."""
    from kvtier.server import ServerSpec, VllmServer

    spec = ServerSpec(name="calibration", model=model, max_model_len=max(lengths) + 64,
                      kv_cache_space_gib=0.25, enable_prefix_caching=False, dtype=dtype)
    start = start_server or VllmServer.start
    t0 = time.monotonic()
    with start(spec, log_path) as server:
        startup = time.monotonic() - t0
        profile = measure_profile(server_prefill_timer(server.base_url), lengths, budget_s=budget_s,
                                  on_point=on_point, time_decode=server_decode_timer(server.base_url))
    return Calibration(profile=profile, startup_s=startup, dtype=dtype)


def obtain_calibration(facts: Any, out: Path, reuse: Path | None,
                       start_server: Callable[..., Any] | None = None) -> Calibration:
    """Reuse a saved calibration (``reuse``) or measure one on a plain server; saved to
    ``out/calibration.json`` either way and printed."""
    from kvtier.demo.common import console, write_json

    if reuse is not None:
        cal = load_calibration(reuse, facts.dtype)
        console.print(f"calibration reused from {reuse}")
    else:
        with console.status("calibrating: cold prefill on a plain vLLM server (about a minute)"):
            cal = calibrate_on_server(str(facts.path), facts.dtype, out / "calibration" / "server.log",
                                      start_server=start_server,
                                      on_point=lambda n, t: console.print(f"[dim]calibration: {n} tokens cold "
                                                                          f"prefill {t:.2f} s[/]"))
    write_json(out / "calibration.json", cal.to_dict())
    p = cal.profile
    console.print(f"this machine ({facts.dtype}): 1K-token cold prefill {p.seconds(1024):.2f} s = "
                  f"{p.speed_factor():.2f}x the reference machine's {REFERENCE_PREFILL_1K_S} s; server start "
                  f"{cal.startup_s:.0f} s")
    if p.decode_points:
        console.print(f"decode step: {p.decode_step_s(1) * 1000:.0f} ms alone, {p.decode_step_s(DECODE_BATCH) * 1000:.0f} ms "
                      f"with {DECODE_BATCH} requests decoding together")
    return cal
