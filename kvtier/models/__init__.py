"""kvtier's models: the bundled real models (``bundled``, converted by ``convert``) and seeded
random-initialised tiny checkpoints for tests (``tiny``). ``kvtier.model`` keeps the default model's API."""

from kvtier.models.bundled import (DEFAULT, GEMMA3, MODELS, SMOLLM2, VERIFY, AnswerCheck, BundledModel,
                                   ModelError, bundled)
from kvtier.models.convert import ModelStatus, ensure_model, model_folder_problem, model_status

__all__ = ["DEFAULT", "GEMMA3", "MODELS", "SMOLLM2", "VERIFY", "AnswerCheck", "BundledModel", "ModelError",
           "ModelStatus", "bundled", "ensure_model", "model_folder_problem", "model_status", "all_ready"]


def all_ready() -> bool:
    """Whether every bundled model's folder is converted (files only; set-up's up-to-date check)."""
    return all(model_status(m.path(), m).ready for m in MODELS.values())
