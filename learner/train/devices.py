"""Where the learner's models live and in which dtype: ``learner.runtime.device`` / ``learner.runtime.dtype`` made
concrete (the rollout side has its own resolver; the packages never import each other).

``auto`` device: the first CUDA device when torch sees one, else the CPU. ``auto`` dtype:
float32 under autocast (mixed precision keeps float32 weights); otherwise bfloat16 on a CUDA device
that computes it natively (half the bytes of weights, activations and full-weight publishes), and
float32 elsewhere (on the CPU always: the tests compare against float32 recomputes). ``auto``
autocast (:func:`resolve_runtime`): bfloat16 where the device computes it natively
(:func:`ops.native_bfloat16`), none elsewhere, where emulated bfloat16 is slower than float32 —
and none when the weights already have a low-precision dtype. A CUDA device that is asked for but
not there is a start-up error, said in one line, before any model is loaded.

:class:`Runtime` is the decision, with the reason for every ``auto`` in it: the learner says it
once at start (the ``runtime`` event), in ``ctl status`` and in ``RUN_DIR/runtime.json`` (the
report's "Runtime" line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ops.precision import cpu_facts, native_bfloat16
from protocol.errors import StartupError

__all__ = ["Runtime", "attention_of", "resolve_device", "resolve_dtype", "resolve_runtime"]

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
    """``auto`` -> bfloat16 on a CUDA device that computes it natively, float32 elsewhere; a named
    dtype as it is."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and native_bfloat16(device)[0] else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise StartupError(f"learner.runtime.dtype={dtype!r}: use auto, {', '.join(_DTYPES)}") from None


def _name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Runtime:
    """Where and in what precision the learner's models compute, and why (``learner.runtime``)."""

    device: torch.device
    dtype: torch.dtype
    """The weights' dtype (float32 under autocast)."""
    autocast: torch.dtype | None
    """The dtype the forward and backward compute in under ``torch.autocast``; None: the weights'."""
    why: dict[str, str] = field(default_factory=dict)
    """Setting -> why ``auto`` chose what it did (only the settings that were ``auto``)."""

    def describe(self, model: torch.nn.Module, attn_setting: str) -> dict[str, object]:
        """The decisions as one flat record (the ``runtime`` event, ``ctl status``, runtime.json):
        what each setting resolved to, why, the thread count and, on a CPU, its bfloat16 features;
        ``line``: all of it in one readable line. ``model``: the loaded policy (its attention)."""
        why = dict(self.why)
        attention, reason = attention_of(model, attn_setting)
        if reason is not None:
            why["attention"] = reason
        info: dict[str, object] = {"device": str(self.device), "dtype": _name(self.dtype),
                                   "autocast": _name(self.autocast), "attention": attention,
                                   "threads": torch.get_num_threads()}
        if self.device.type == "cpu":
            info.update(cpu_facts())
        info["why"] = why
        info["line"] = "; ".join(f"{k} {info[k]}" + (f" ({why[k]})" if k in why else "")
                                 for k in ("device", "dtype", "autocast", "attention", "threads"))
        return info


def resolve_runtime(runtime) -> Runtime:
    """``learner.runtime``'s device, dtype and autocast made concrete (module docstring)."""
    device = resolve_device(runtime.device)
    why = {}
    if runtime.device == "auto":
        why["device"] = "auto: " + ("torch sees a CUDA device" if device.type == "cuda" else "no CUDA device")
    if runtime.autocast == "auto":
        if runtime.dtype not in ("auto", "float32"):
            autocast, why["autocast"] = None, f"auto: the weights are {runtime.dtype} already"
        else:
            native, reason = native_bfloat16(device)
            autocast, why["autocast"] = (torch.bfloat16 if native else None), f"auto: {reason}"
    else:
        autocast = None if runtime.autocast == "none" else getattr(torch, runtime.autocast)
    if autocast is not None:        # mixed precision keeps float32 weights (dtype auto included)
        dtype = torch.float32
        if runtime.dtype == "auto":
            why["dtype"] = "auto: float32 weights under autocast"
    else:
        dtype = resolve_dtype(runtime.dtype, device)
        if runtime.dtype == "auto":
            why["dtype"] = ("auto: the device computes bfloat16 natively" if dtype == torch.bfloat16
                            else "auto: float32 on this device")
    return Runtime(device=device, dtype=dtype, autocast=autocast, why=why)


def attention_of(model: torch.nn.Module, setting: str) -> tuple[str, str | None]:
    """(the attention ``model`` runs, why when ``setting`` was ``auto``): transformers keeps its
    choice in ``config._attn_implementation`` (a PEFT model shows its base model's)."""
    chosen = getattr(getattr(model, "config", None), "_attn_implementation", None) or setting
    return chosen, ("auto: the model's default" if setting == "auto" else None)
