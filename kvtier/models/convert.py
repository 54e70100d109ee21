"""Converting a bundled model once into a Hugging Face folder, and the folder's status.

``ensure_model()`` converts the model's GGUF with transformers + gguf + accelerate into its folder under
``<kvtier home>/models/``: the weights are dequantized, the quantizer state stripped, the weights saved in
bfloat16 (safetensors), the tokenizer fixed where the GGUF lacks something (chat template, BOS), the
folder verified by loading it and checking the model's greedy answer in float32, and published
atomically (temp dir + rename). Status checks are cheap (files only) for ``doctor`` and set-up.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvtier.models.bundled import DEFAULT, AnswerCheck, BundledModel, ModelError, gguf_file, gguf_fingerprint

MARKER = "kvtier-model.json"


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


def model_status(path: Path | None = None, model: BundledModel = DEFAULT) -> ModelStatus:
    """Check a converted model folder without loading weights (cheap; used by ``doctor`` and set-up)."""
    path = path or model.path()
    if not path.is_dir():
        return ModelStatus(path, False, f"model folder {path} does not exist (run `make setup`)")
    for name in ("config.json", "tokenizer.json", MARKER):
        if not (path / name).is_file():
            return ModelStatus(path, False, f"model folder {path} is incomplete: {name} missing")
    if not any(path.glob("*.safetensors")):
        return ModelStatus(path, False, f"model folder {path} has no .safetensors weights")
    return ModelStatus(path, True)


def weights_fingerprint(path: Path) -> str:
    """A stable identity of the weights: the marker written at conversion, or file names+sizes."""
    marker = path / MARKER
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


def greedy_answer(folder: Path, check: AnswerCheck, max_new_tokens: int = 8) -> str:
    """The float32 model's greedy continuation of ``check.answer_start`` (transformers, chat template)."""
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


def _fix_tokenizer(tok, model: BundledModel) -> None:
    if model.chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = model.chat_template
    if model.add_bos:
        tok.add_bos_token = True


def _bos_problem(folder: Path) -> str | None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Hello").input_ids
    return None if ids and ids[0] == tok.bos_token_id else f"the saved tokenizer adds no BOS ({ids[:3]})"


def convert_gguf(gguf: Path, dest: Path, model: BundledModel = DEFAULT) -> Path:
    """Convert the GGUF file into an HF folder at ``dest`` (atomic publish); ``ModelError`` when the
    converted folder fails its check (then nothing is published)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _fix_tokenizer(tok, model)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # Strip quantizer state: the weights are dequantized, the saved folder must not claim GGUF quantization.
        hf.hf_quantizer = None
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.is_quantized = False
        hf = hf.to(torch.bfloat16)
        hf.config.torch_dtype = torch.bfloat16
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        del hf
        problem = _bos_problem(tmp) if model.add_bos else None
        answer = greedy_answer(tmp, model.check)
        if problem is None and not model.check.passes(answer):
            problem = f"{model.check.question!r} -> {model.check.answer_start + answer!r}"
        if problem:
            raise ModelError(f"converted model {model.name} failed verification: {problem}")
        (tmp / MARKER).write_text(json.dumps({"model": model.name, "source": gguf.name,
                                              "fingerprint": gguf_fingerprint(gguf),
                                              "verify_answer": answer}, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_model(path: Path | None = None, model: BundledModel = DEFAULT) -> Path:
    """Return a ready model folder, converting the bundled GGUF once if needed (idempotent, fast when done)."""
    path = path or model.path()
    if model_status(path, model).ready:
        return path
    with gguf_file(model) as gguf:
        return convert_gguf(gguf, path, model)
