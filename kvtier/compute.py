"""What this CPU computes fast, and the one place that turns a dtype into KV bytes.

``cpu_facts()`` reads torch's CPU capability and ``/proc/cpuinfo`` (model name and flags);
``choose_dtype()`` picks the compute dtype for the bundled model: bfloat16 only where the
CPU has native bf16 arithmetic (x86 ``avx512_bf16`` / ``amx_bf16``, ARM ``bf16`` / ``svebf16``),
float32 otherwise — on an AVX2-only CPU torch's bf16 matmul is emulated (measured
~30x slower than float32 on an AMD EPYC AVX2 machine). ``kv_bytes_per_token()`` / ``kv_bytes()`` are THE formula for KV sizes
(2 (K and V) x layers x kv_heads x head_dim x itemsize); every other module calls them.

Everything here is side-effect free except reading ``/proc/cpuinfo`` and the environment;
torch is imported lazily (the core imports without it).
"""

from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("bfloat16", "float32", "float16")
ENV_VAR = "KVTIER_DTYPE"
SOURCES = ("auto", "cli", "env", "config")

# Element sizes of the dtypes a KV cache can hold (vLLM's cache_dtype names included).
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4,
             "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

# cpuinfo flags that mean native bf16 / fp16 arithmetic (x86 `flags`, ARM `Features`).
_X86_BF16 = frozenset({"avx512_bf16", "amx_bf16"})
_ARM_BF16 = frozenset({"bf16", "svebf16", "sve_bf16"})
_X86_FP16 = frozenset({"avx512_fp16", "amx_fp16"})
_ARM_FP16 = frozenset({"fphp", "asimdhp"})


KEY_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                       "amx_bf16", "amx_fp16", "amx_int8", "asimd", "asimdhp", "fphp", "sve", "sve2", "bf16",
                       "svebf16", "i8mm"})


class DtypeError(ValueError):
    """A dtype name kvtier does not know (one-line message)."""


@dataclass(frozen=True)
class CpuFacts:
    capability: str           # torch.backends.cpu.get_cpu_capability(), e.g. "AVX2", "AVX512", "DEFAULT"
    model_name: str           # /proc/cpuinfo "model name" (x86) or a best-effort ARM description
    flags: frozenset[str]     # /proc/cpuinfo "flags" (x86) or "Features" (ARM)
    native_bf16: bool

    @property
    def native_fp16(self) -> bool:
        return bool(self.flags & (_X86_FP16 | _ARM_FP16))

    @property
    def key_flags(self) -> list[str]:
        """The flags that decide the matmul speed of float32 / bf16 / fp16 here, sorted."""
        return sorted(self.flags & KEY_FLAGS)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                # one of DTYPES
    source: str               # one of SOURCES: who decided
    reason: str               # one line, for logs and `kvtier doctor`
    emulated: bool            # True: this CPU has no native arithmetic for the dtype (slow)

    def describe(self) -> str:
        """One line: ``dtype float32 (auto: ...)``; with a warning when the dtype is emulated."""
        warn = " [WARNING: emulated on this CPU, expect it to be many times slower]" if self.emulated else ""
        return f"dtype {self.dtype} ({self.source}: {self.reason}){warn}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from the text of /proc/cpuinfo (x86 or ARM); side-effect free."""
    model = ""
    flags: set[str] = set()
    arm_parts: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "model name" and not model:
            model = value
        elif key in ("flags", "features") and not flags:
            flags = set(value.lower().split())
        elif key in ("cpu implementer", "cpu part", "hardware") and key not in arm_parts:
            arm_parts[key] = value
    if not model and arm_parts:
        model = " ".join(f"{k} {v}" for k, v in sorted(arm_parts.items()))
    return model, frozenset(flags)


def has_native_bf16(flags: frozenset[str]) -> bool:
    return bool(flags & (_X86_BF16 | _ARM_BF16))


def facts_from(cpuinfo_text: str, capability: str) -> CpuFacts:
    """CpuFacts from given cpuinfo text and torch capability (for tests and for cpu_facts)."""
    model, flags = parse_cpuinfo(cpuinfo_text)
    return CpuFacts(capability=capability, model_name=model or platform.processor() or "unknown",
                    flags=flags, native_bf16=has_native_bf16(flags))


def _torch_capability() -> str:
    try:
        import torch
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # torch missing or too old: the flags still decide
        return "unknown"


@functools.lru_cache(maxsize=1)
def cpu_facts() -> CpuFacts:
    """This machine's CPU facts (cached for the process)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return facts_from(text, _torch_capability())


def normalize_dtype(name: object) -> str:
    """Canonical dtype name: accepts "bf16", "torch.float32", a torch.dtype, ... Raises DtypeError."""
    s = str(name).strip().lower().removeprefix("torch.")
    s = _ALIASES.get(s, s)
    if s not in _ITEMSIZE:
        raise DtypeError(f"unknown dtype {name!r}: use auto, bfloat16, float32 or float16")
    return s


def dtype_itemsize(name: object) -> int:
    """Bytes per element of a KV dtype name (or torch.dtype); raises DtypeError for unknown names."""
    return _ITEMSIZE[normalize_dtype(name)]


def _emulated(dtype: str, facts: CpuFacts) -> bool:
    if dtype == "bfloat16":
        return not facts.native_bf16
    if dtype == "float16":
        return not facts.native_fp16
    return False


def choose_dtype(requested: str | None = None, *, source: str = "cli", facts: CpuFacts | None = None,
                 env: dict[str, str] | None = None) -> DtypeChoice:
    """The compute dtype for the bundled model.

    ``requested`` None or "auto": ``$KVTIER_DTYPE`` if set (source "env", may itself be "auto"),
    else from the CPU (source "auto"): bfloat16 with native bf16, float32 otherwise. Any other
    value is taken as forced (``source`` names who forced it: "cli" or "config") and flagged
    ``emulated`` when the CPU lacks native arithmetic for it. Raises DtypeError for an unknown name.
    Side-effect free (reads the environment and the cached CPU facts only).
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    facts = facts or cpu_facts()
    env = os.environ if env is None else env
    req = (requested or "auto").strip().lower()
    if req == "auto":
        env_value = (env.get(ENV_VAR) or "").strip()
        if env_value and env_value.lower() != "auto":
            try:
                dtype = normalize_dtype(env_value)
            except DtypeError:
                raise DtypeError(f"{ENV_VAR}={env_value!r} is not a dtype: use auto, bfloat16, float32 or "
                                 "float16") from None
            return _forced(dtype, "env", f"{ENV_VAR}={env_value}", facts)
        cpu = f"{facts.capability} CPU" + (f" ({facts.model_name})" if facts.model_name else "")
        if facts.native_bf16:
            hit = sorted(facts.flags & (_X86_BF16 | _ARM_BF16))
            return DtypeChoice("bfloat16", "auto", f"{cpu} has native bf16 ({', '.join(hit)})", False)
        return DtypeChoice("float32", "auto", f"{cpu} has no native bf16, so bf16 matmul would be "
                                              "emulated (many times slower); float32 is faster here", False)
    dtype = normalize_dtype(req)
    return _forced(dtype, source, f"requested {dtype}", facts)


def _forced(dtype: str, source: str, why: str, facts: CpuFacts) -> DtypeChoice:
    if dtype not in DTYPES:
        raise DtypeError(f"dtype {dtype!r} is not a compute dtype: use auto, bfloat16, float32 or float16")
    emulated = _emulated(dtype, facts)
    note = f"; {facts.capability} CPU has no native {dtype}" if emulated else ""
    return DtypeChoice(dtype, source, why + note, emulated)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, itemsize: int, tokens: int = 1) -> int:
    """KV bytes of ``tokens`` tokens: 2 (K and V) x layers x kv_heads x head_dim x itemsize x tokens."""
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * int(itemsize) * int(tokens)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV bytes per token of the HF model in ``model_dir`` with KV in ``dtype`` ("auto" -> choose_dtype).

    Reads ``config.json`` only (num_hidden_layers, num_key_value_heads, head_dim or
    hidden_size / num_attention_heads). Raises OSError / KeyError / ValueError on a bad folder.
    """
    if str(dtype).strip().lower() == "auto":
        dtype = choose_dtype("auto").dtype
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return kv_bytes(cfg["num_hidden_layers"], kv_heads, head_dim, dtype_itemsize(dtype))


_announced: set[DtypeChoice] = set()


def announce(choice: DtypeChoice, emit=None) -> bool:
    """Say ``choice.describe()`` once per process (``emit``: a one-argument callable; default: stderr).

    Returns True when this call printed it. A forced emulated dtype is said as a warning.
    """
    if choice in _announced:
        return False
    _announced.add(choice)
    line = f"kvtier: {choice.describe()}"
    if emit is None:
        import sys
        print(line, file=sys.stderr, flush=True)
    else:
        emit(line)
    return True
