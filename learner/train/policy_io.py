"""The policy model's I/O outside a step: how it is loaded (attention implementation), its optimizer,
what a publish carries (full tensors, or a LoRA adapter and its config) and its state for a
checkpoint. Functions of the model alone, so the plain and the DeepSpeed strategy share them."""

from __future__ import annotations

from pathlib import Path

import torch

from protocol import LoraSpec
from protocol.errors import StartupError
from protocol.schema import wire_field_names

LORA_PUBLISH_FIELDS = wire_field_names(LoraSpec)
"""The PEFT ``LoraConfig`` fields a LoRA publish carries (``WeightsAvailable.lora``, a
``protocol.LoraSpec``): what a rollout engine needs to build the same adapter (the HF engine
passes them to ``LoraConfig``, vLLM's writes them into ``adapter_config.json``)."""


def attn_kwargs(attn_implementation: str) -> dict[str, str]:
    """``from_pretrained``'s keyword for ``learner.runtime.attn_implementation`` (none for auto);
    StartupError when it needs a package this environment lacks."""
    if attn_implementation == "auto":
        return {}
    if attn_implementation == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            raise StartupError("learner.runtime.attn_implementation: flash_attention_2 needs the flash-attn "
                               "package and a CUDA GPU; use sdpa or eager")
    return {"attn_implementation": attn_implementation}


def adamw(params, **kw) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it has one for these parameters (CPU and CUDA
    floating point): one kernel over every tensor instead of a dozen small ops per tensor, the
    same update (the demo's policy on one thread: an optimizer step 2.56 -> 0.67 ms, 3 % of the
    step). Parameters it cannot take get the default implementation."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, **kw)


def lora_publish_fields(model) -> LoraSpec:
    """The :data:`LORA_PUBLISH_FIELDS` of a PEFT model's live adapter config (target modules as
    PEFT resolved them, e.g. ``all-linear`` -> the module names, sorted)."""
    live = model.peft_config["default"]
    out = {}
    for name in LORA_PUBLISH_FIELDS:
        value = getattr(live, name)
        if isinstance(value, (set, frozenset, list, tuple)):
            value = sorted(value)
        out[name] = value
    return LoraSpec(**out)


def publish_tensors(model, *, lora: bool) -> list[tuple[str, torch.Tensor]]:
    """What a publish sends: every parameter (tied ones once), or the adapter's tensors under
    ``get_peft_model_state_dict`` names."""
    if lora:
        from peft import get_peft_model_state_dict

        return [(n, t.detach()) for n, t in get_peft_model_state_dict(model).items()]
    return [(n, p.detach()) for n, p in model.named_parameters()]


def save_pretrained(model, tokenizer, path: str | Path) -> Path:
    """``save_pretrained`` of the policy (the full model, or a PEFT model's adapter) and of the
    tokenizer into ``path`` (made if missing); returns it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()     # a "Writing model shards" bar on stderr at every save
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def policy_state(model, *, lora: bool) -> dict[str, torch.Tensor]:
    """The policy's tensors a checkpoint saves: the adapter alone under LoRA, else the state dict."""
    if lora:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def load_policy_state(model, state: dict[str, torch.Tensor], *, lora: bool) -> None:
    """The adapter's tensors (``get_peft_model_state_dict`` names) under LoRA, or the model's own
    ``state_dict`` (any kind: every key a key of the live model, loaded strictly)."""
    live = model.state_dict()
    if state and all(k in live for k in state):
        model.load_state_dict(state)
        return
    if lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"checkpoint policy: adapter tensors unknown here: {unexpected[:3]}")
        return
    model.load_state_dict(state)


def load_policy(cfg, model_path: str, dtype: torch.dtype, device: torch.device):
    """``(tokenizer, model, lora_config)``: the policy loaded in ``dtype`` onto ``device``, dropout
    off (``disable_dropout``), gradient checkpointing (``gradient_checkpointing``) and, under
    ``learner.lora``, wrapped by PEFT (``lora_config`` None otherwise). ``cfg`` is the learner's
    config; a LoRA PEFT refuses (target modules not in the model) is a StartupError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.train.dropout import disable_dropout

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **attn_kwargs(cfg.runtime.attn_implementation))
    if cfg.runtime.disable_dropout:
        disable_dropout(model)          # the base's; an adapter's lora.dropout is the config's
    model.to(device)
    if cfg.runtime.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    lora_config = None
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                 target_modules=cfg.lora.target_modules, bias="none", task_type="CAUSAL_LM")
        try:
            model = get_peft_model(model, lora_config)
        except ValueError as e:             # e.g. target modules not found in the model
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StartupError(f"learner.lora: {msg[:300]}") from None
        if cfg.runtime.gradient_checkpointing:
            model.enable_input_require_grads()   # the frozen embedding's output needs grad
    return tokenizer, model, lora_config
