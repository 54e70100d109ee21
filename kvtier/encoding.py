"""Shared-tier chunk encodings: how a chunk payload is packed before it goes to a shared backend.

``store.shared.encoding`` picks one (default ``plain``); the RAM and SSD tiers always hold plain
payloads. An encoded payload is a *frame*, itself the payload of an ordinary verified chunk
(``kvtier.chunk``: the checksum or MAC covers the frame), so a reader verifies first and decodes
second. Frame layout (little-endian)::

    magic "KVTX" | u8 codec | u8 mode | u16 reserved (0) | u64 plain payload length
    codec data

Codecs:

* ``plain`` (0) — no frame at all: the shared tier stores the payload as every other tier does.
* ``zstd`` (1), lossless — mode bit 0: zstd-compressed, bit 1: byte-shuffled first (the i-th byte
  of every element together, so the exponent bytes of float KV sit side by side). Without bit 0 the
  data is the (shuffled) payload stored as is: a payload zstd cannot shrink is never stored larger
  than plain plus the frame header.
* ``int8`` (2), lossy — symmetric 8-bit quantization per channel. A payload of shape
  ``[..., T, C]`` (the chunk payloads of ``kvtier.transfer.page_layout``: ``T`` the tokens of
  one block, ``C`` the channels, for the CPU layout K's ``head_size`` channels followed by V's) is
  viewed as ``[G, T, C]``; every (group, channel) gets ``scale = max|x| / 127`` over its ``T``
  tokens and ``q = round(x / scale)``. Data: ``u32 G, u32 T, u32 C`` | float32 scales ``[G, C]`` |
  int8 ``[G, T, C]``. Decoded values are ``q * scale`` in the payload's dtype: the error of each
  element is at most ``scale / 2`` (float32), plus the dtype's own rounding (bfloat16, float16).
  Mode 0 means "stored as is": payloads int8 cannot carry (other dtypes, fewer than 2 axes,
  non-finite values) are kept exact, never approximated wrongly.

Decoding checks every length against the frame and the chunk meta before writing a byte; any
mismatch is ``EncodingError("corrupt")`` (a counted miss for the caller).
"""

from __future__ import annotations

import math
import struct
from typing import Literal

import numpy as np

Encoding = Literal["plain", "zstd", "int8"]
ENCODINGS: tuple[str, ...] = ("plain", "zstd", "int8")
MAGIC = b"KVTX"
_FRAME = struct.Struct("<4sBBHQ")
_INT8_GEOM = struct.Struct("<III")
FRAME_HEADER = _FRAME.size
#: an encoded payload is at most this many bytes larger than the plain one
MAX_OVERHEAD = FRAME_HEADER + _INT8_GEOM.size
_CODEC_ID = {"zstd": 1, "int8": 2}
_ZSTD_LEVEL = 3
_COMPRESSED, _SHUFFLED = 1, 2
_QUANTIZED = 1
_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
_FLOAT_NP = {"float32": np.float32, "float": np.float32, "float16": np.float16, "half": np.float16}


class EncodingError(Exception):
    """An encoded payload that does not decode; ``kind`` is the counted event ("corrupt")."""

    def __init__(self, message: str, kind: str = "corrupt") -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def check_encoding(name: str) -> str:
    """``name`` if it is a known encoding; ValueError (one line) otherwise."""
    if name not in ENCODINGS:
        raise ValueError(f"unknown shared-tier encoding {name!r}; known: {', '.join(ENCODINGS)}")
    return name


def require_codec(name: str) -> None:
    """Import what ``name`` needs now (a clear error at open, never at the first write)."""
    if check_encoding(name) == "zstd":
        _zstd()


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ImportError("store.shared.encoding=zstd needs the Python package 'zstandard' "
                          "(pip install zstandard)") from None
    return zstandard


def encode(name: str, payload: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> bytes | memoryview:
    """The frame of ``payload`` (a chunk of ``shape`` / ``dtype``) under encoding ``name``
    (``plain``: the payload itself). Never fails for a valid encoding name: what a codec cannot
    carry is stored exactly."""
    if check_encoding(name) == "plain":
        return payload
    view = memoryview(payload).cast("B") if memoryview(payload).format != "B" else memoryview(payload)
    if name == "zstd":
        return _encode_zstd(view, _ITEMSIZE.get(dtype, 1))
    return _encode_int8(view, shape, dtype)


def plain_length(name: str, frame: bytes | memoryview) -> int:
    """The plain payload length a frame decodes to (checked header; ``EncodingError`` otherwise)."""
    if name == "plain":
        return len(frame)
    return _header(name, memoryview(frame))[1]


def decode_into(name: str, frame: bytes | memoryview, out: memoryview, shape: tuple[int, ...],
                dtype: str) -> int:
    """Decode ``frame`` into ``out[:n]``; returns ``n``, the plain payload length. ValueError if
    ``out`` is too small (a caller's bug); ``EncodingError`` if the frame is not a valid encoding."""
    src = memoryview(frame)
    if name == "plain":
        n = len(src)
        _room(out, n)
        out[:n] = src
        return n
    mode, n = _header(name, src)
    _room(out, n)
    body = src[FRAME_HEADER:]
    if name == "zstd":
        _decode_zstd(body, mode, n, _ITEMSIZE.get(dtype, 1), out)
    else:
        _decode_int8(body, mode, n, shape, dtype, out)
    return n


def _room(out: memoryview, n: int) -> None:
    if len(out) < n:
        raise ValueError(f"output buffer of {len(out)} B is smaller than the {n}-byte payload")


def _frame(name: str, mode: int, n: int) -> bytes:
    return _FRAME.pack(MAGIC, _CODEC_ID[name], mode, 0, n)


def _header(name: str, src: memoryview) -> tuple[int, int]:
    if len(src) < FRAME_HEADER:
        raise EncodingError(f"frame of {len(src)} B is shorter than its header")
    magic, codec, mode, reserved, n = _FRAME.unpack_from(src, 0)
    if magic != MAGIC or reserved:
        raise EncodingError("bad frame magic")
    if codec != _CODEC_ID[name]:
        raise EncodingError(f"frame codec {codec} is not {name!r}")
    return mode, n


# -- zstd ---------------------------------------------------------------------------------------------
def _shuffle(view: memoryview, itemsize: int) -> np.ndarray:
    return np.frombuffer(view, np.uint8).reshape(-1, itemsize).T.copy()


def _encode_zstd(view: memoryview, itemsize: int) -> bytes:
    n = len(view)
    shuffle = itemsize > 1 and n % itemsize == 0
    data = _shuffle(view, itemsize) if shuffle else view
    packed = _zstd().ZstdCompressor(level=_ZSTD_LEVEL).compress(data)
    mode = _SHUFFLED if shuffle else 0
    if len(packed) < n:
        return _frame("zstd", mode | _COMPRESSED, n) + packed
    return _frame("zstd", mode, n) + (data.tobytes() if shuffle else bytes(view))


def _decode_zstd(body: memoryview, mode: int, n: int, itemsize: int, out: memoryview) -> None:
    if mode & ~(_COMPRESSED | _SHUFFLED):
        raise EncodingError(f"unknown zstd frame mode {mode:#x}")
    if mode & _COMPRESSED:
        try:
            raw = _zstd().ZstdDecompressor().decompress(body, max_output_size=n)
        except Exception as e:           # zstd.ZstdError: a frame that does not decompress
            raise EncodingError(f"zstd: {e}") from None
    else:
        raw = body
    if len(raw) != n:
        raise EncodingError(f"zstd frame holds {len(raw)} B, its header says {n}")
    if not mode & _SHUFFLED:
        out[:n] = raw
        return
    if itemsize <= 1 or n % itemsize:
        raise EncodingError(f"shuffled frame of {n} B does not match item size {itemsize}")
    dst = np.frombuffer(out[:n], np.uint8).reshape(-1, itemsize)
    dst[...] = np.frombuffer(raw, np.uint8).reshape(itemsize, -1).T


# -- int8 ---------------------------------------------------------------------------------------------
def _geometry(shape: tuple[int, ...], dtype: str, n: int) -> tuple[int, int, int] | None:
    """(groups, tokens, channels) when int8 can carry this payload, else None."""
    if dtype not in ("float32", "float", "bfloat16", "float16", "half") or len(shape) < 2:
        return None
    t, c = int(shape[-2]), int(shape[-1])
    g = math.prod(int(s) for s in shape[:-2])
    if g * t * c == 0 or g * t * c * _ITEMSIZE[dtype] != n:
        return None
    return g, t, c


def _as_float32(view: memoryview, dtype: str, geom: tuple[int, int, int]) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(view, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(geom)
    return np.frombuffer(view, _FLOAT_NP[dtype]).astype(np.float32, copy=False).reshape(geom)


def _encode_int8(view: memoryview, shape: tuple[int, ...], dtype: str) -> bytes:
    n = len(view)
    geom = _geometry(shape, dtype, n)
    if geom is not None:
        x = _as_float32(view, dtype, geom)
        absmax = np.abs(x).max(axis=1)                        # [G, C]
        if np.isfinite(absmax).all():
            scale = (absmax / np.float32(127.0)).astype(np.float32)
            inv = np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale > 0)
            q = np.rint(x * inv[:, None, :])
            np.clip(q, -127, 127, out=q)
            return b"".join((_frame("int8", _QUANTIZED, n), _INT8_GEOM.pack(*geom), scale.tobytes(),
                             q.astype(np.int8).tobytes()))
    return _frame("int8", 0, n) + bytes(view)


def _decode_int8(body: memoryview, mode: int, n: int, shape: tuple[int, ...], dtype: str,
                 out: memoryview) -> None:
    if mode == 0:
        if len(body) != n:
            raise EncodingError(f"stored int8 frame holds {len(body)} B, its header says {n}")
        out[:n] = body
        return
    if mode != _QUANTIZED or len(body) < _INT8_GEOM.size:
        raise EncodingError(f"bad int8 frame (mode {mode:#x}, {len(body)} B)")
    geom = _INT8_GEOM.unpack_from(body, 0)
    if _geometry(shape, dtype, n) != geom:
        raise EncodingError(f"int8 frame geometry {geom} does not match shape {shape} / {dtype}")
    g, t, c = geom
    off = _INT8_GEOM.size
    if len(body) != off + 4 * g * c + g * t * c:
        raise EncodingError(f"int8 frame of {len(body)} B does not match geometry {geom}")
    scale = np.frombuffer(body, np.float32, g * c, off).reshape(g, 1, c)
    q = np.frombuffer(body, np.int8, g * t * c, off + 4 * g * c).reshape(g, t, c)
    dst = out[:n]
    if dtype == "float32" or dtype == "float":
        np.multiply(q, scale, out=np.frombuffer(dst, np.float32).reshape(g, t, c))
        return
    x = np.multiply(q, scale, dtype=np.float32)
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))   # round to nearest even
        np.right_shift(u, np.uint32(16), out=np.frombuffer(dst, np.uint16).reshape(g, t, c), casting="unsafe")
    else:
        np.frombuffer(dst, np.float16).reshape(g, t, c)[...] = x
