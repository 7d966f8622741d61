"""Where the learner's models live and in which dtype: ``learner.runtime.device`` / ``learner.runtime.dtype`` made
concrete (the rollout side has its own resolver; the packages never import each other).

``auto`` device: the first CUDA device when torch sees one, else the CPU. ``auto`` dtype:
bfloat16 on CUDA (the accelerator's native training width: half the bytes of weights, activations
and full-weight publishes), float32 on the CPU (CPU bfloat16 matmuls are slower than float32 ones
on most cores, and the tests compare against float32 recomputes). A CUDA device that is asked for
but not there is a start-up error, said in one line, before any model is loaded.
"""

from __future__ import annotations

import torch

from protocol.errors import StartupError

__all__ = ["resolve_device", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a ``torch.device`` that exists here."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise StartupError(f"learner.runtime.device={device}: torch sees no CUDA device here; "
                               "set learner.runtime.device: cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise StartupError(f"learner.runtime.device={device}: only {torch.cuda.device_count()} CUDA "
                               f"device(s) here; use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere; a named dtype as it is."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise StartupError(f"learner.runtime.dtype={dtype!r}: use auto, {', '.join(_DTYPES)}") from None
