"""docs/configuration.md documents every configuration field (it is hand-written: keep it true)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from kvtier.config import KvtierConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_config_field_is_documented():
    text = DOC.read_text()
    fields = list(_fields(KvtierConfig))
    assert len(fields) > 20
    missing = [f for f in fields if f"`{f}`" not in text]
    assert missing == [], f"add these fields to docs/configuration.md: {missing}"
