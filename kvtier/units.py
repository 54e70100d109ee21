"""Numbers for people: seconds, ratios, percentages, bytes and rates with units and sensible precision.

Every function takes ``None`` (or a NaN) and returns ``DASH`` for it, so a missing figure prints
as a dash rather than ``None``/``nan``. Precision follows the size of the value: three significant
digits for seconds and bytes (``4.88 s``, ``12.3 ms``, ``1.50 GiB``), two decimals for ratios
below 10 (``2.54x``), one decimal for percentages (``63.1%``). No third-party imports.
"""

from __future__ import annotations

import math

DASH = "–"


def _missing(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _sig3(v: float) -> str:
    """Three significant digits, fixed-point (``123``, ``12.3``, ``1.23``)."""
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def num_s(v: float | None) -> str:
    """Seconds as a bare number for a column headed "(s)": ``4.88``, ``0.452``, ``123``."""
    if _missing(v):
        return DASH
    assert v is not None
    return _sig3(v) if abs(v) >= 1 or v == 0 else f"{v:.3f}"


def seconds(v: float | None) -> str:
    """A duration with its unit: ``4.88 s``, ``45.2 ms``, ``812 us``, ``2.0 min`` above 10 minutes."""
    if _missing(v):
        return DASH
    assert v is not None
    a = abs(v)
    if a >= 600:
        return f"{v / 60:.1f} min"
    if a >= 0.1 or a == 0:
        return f"{_sig3(v)} s"
    if a >= 1e-4:
        return f"{_sig3(v * 1e3)} ms"
    return f"{_sig3(v * 1e6)} us"


def ratio(v: float | None) -> str:
    """A speed-up or a ratio: ``2.54x``, ``13.1x``, ``412x``."""
    if _missing(v):
        return DASH
    assert v is not None
    a = abs(v)
    return f"{v:.0f}x" if a >= 100 else f"{v:.1f}x" if a >= 10 else f"{v:.2f}x"


def percent(fraction: float | None) -> str:
    """A fraction in [0, 1] as a percentage: ``0.631`` -> ``63.1%``."""
    if _missing(fraction):
        return DASH
    assert fraction is not None
    return f"{100 * fraction:.1f}%"


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def nbytes(n: float | None) -> str:
    """A size in binary units: ``0 B``, ``512 B``, ``1.50 GiB``, ``12.3 MiB``."""
    if _missing(n):
        return DASH
    assert n is not None
    if n == 0:
        return "0 B"
    i = min(len(_BINARY) - 1, max(0, int(math.log(abs(n), 1024))))
    if i == 0:
        return f"{n:.0f} B"
    return f"{_sig3(n / 1024 ** i)} {_BINARY[i]}"


def gbps(v: float | None) -> str:
    """A throughput given in GB/s (10^9 bytes per second): ``2.54 GB/s``."""
    if _missing(v):
        return DASH
    assert v is not None
    return f"{_sig3(v)} GB/s"


def ms(v_ms: float | None) -> str:
    """A latency already in milliseconds: ``0.42 ms``, ``12.3 ms``."""
    if _missing(v_ms):
        return DASH
    assert v_ms is not None
    return f"{_sig3(v_ms)} ms"


def count(n: float | None) -> str:
    """A count with thousands separators: ``12,345``."""
    if _missing(n):
        return DASH
    assert n is not None
    return f"{n:,.0f}"
