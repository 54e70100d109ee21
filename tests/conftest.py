"""Shared fixtures. Integration tests use the bundled model prepared by `make setup`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use if needed)."""
    from kvtier.model import ensure_model

    return ensure_model()
