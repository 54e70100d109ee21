"""What besides token ids goes into a request's chunk keys (LoRA, cache salt, multimodal inputs).

``request_extra(request)`` is side-effect free; a request object lacking an attribute the key
depends on raises ``KeyFieldsMissing`` (the scheduler then does not cache it, counted), so two
requests that differ in it never share keys.
"""

from __future__ import annotations

from typing import Any


#: Request attributes the chunk key is built from besides the token ids. vLLM 0.32's ``Request`` has
#: all three (None / empty when unused); if an engine version drops or renames one, two requests
#: that differ in it would share keys — so such a request is not cached at all (counted).
KEY_FIELDS = ("lora_request", "cache_salt", "mm_features")


class KeyFieldsMissing(ValueError):
    """The request object lacks an attribute the chunk key depends on (engine API change)."""


def request_extra(request: Any) -> bytes:
    """Extra key bytes for everything besides token ids that changes KV: LoRA, cache salt, mm inputs.

    Raises KeyFieldsMissing when ``request`` lacks one of ``KEY_FIELDS``: never merge keys silently."""
    missing = [f for f in KEY_FIELDS if not hasattr(request, f)]
    if missing:
        raise KeyFieldsMissing(f"request has no {', '.join(missing)}")
    parts: list[str] = []
    lora = request.lora_request
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}:"
                     f"{getattr(lora, 'lora_path', '')}")
    salt = request.cache_salt
    if salt:
        parts.append(f"salt={salt}")
    features = request.mm_features or []
    mm = [getattr(f, "identifier", None) for f in features]
    if any(not m for m in mm):
        raise KeyFieldsMissing("a multimodal input has no identifier (hash)")
    if mm:
        parts.append("mm=" + ",".join(str(m) for m in mm))
    return "\x1f".join(parts).encode() if parts else b""
