"""Shared fixtures. Integration tests use the bundled model prepared by `make setup`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Timeout discipline (pytest-timeout): every test has a bound sized for the slowest CPU class CI runs
# on (2-core AVX2, float32). A test without its own @pytest.mark.timeout gets the default of its kind
# (pyproject's `timeout` is only a backstop); an integration test that needs longer says so, and its
# owner keeps it within the suite budget (README "Durations").
UNIT_TIMEOUT_S = 120
INTEGRATION_TIMEOUT_S = 600


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            limit = INTEGRATION_TIMEOUT_S if item.get_closest_marker("integration") else UNIT_TIMEOUT_S
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use if needed)."""
    from kvtier.model import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def gemma3_model() -> Path:
    """The converted gemma-3-270m folder (the second bundled model; converted on first use if needed)."""
    from kvtier.models import GEMMA3, ensure_model

    return ensure_model(model=GEMMA3)


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(name) -> Path``: a seeded random-initialised tiny checkpoint (``kvtier.models.tiny.TINY``:
    mistral-swa, llama-kv4, deepseek-mla, qwen3-next, gemma3-tiny), made once into kvtier's cache."""
    from kvtier.models.tiny import ensure_tiny

    return ensure_tiny
