"""The DeepSpeed engines' part of a checkpoint: ``engine/`` (learner.train.distributed, "Checkpoints"
and "RNG states per rank").

    engine.safetensors   <model>/fp32/<param>, <model>/exp_avg/<param>, <model>/exp_avg_sq/<param>:
                         each trained parameter's float32 master and Adam moments, whole
    rng.safetensors      rank<r>/<key>: the byte tensors of rank r's RNG states
    engine.json          zero_stage, world, precision, adam_steps {model: n}, rng [rank r's state]

Every tensor is gathered whole from the ranks' partitions and written by rank 0 (safetensors and
JSON: no pickle), so a resume does not depend on the number of ranks or the ZeRO stage; resuming,
every rank reads the files and sets its own partitions. ``<model>`` is ``policy`` or ``critic``.
Both functions are collective: every rank calls them, in the same order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from learner.train.ds_group import Group, seed_rank

__all__ = ["ADAM_STATES", "ENGINE_JSON", "ENGINE_RNG", "ENGINE_TENSORS", "load_engine", "save_engine"]

ADAM_STATES = ("exp_avg", "exp_avg_sq")
ENGINE_TENSORS = "engine.safetensors"
ENGINE_JSON = "engine.json"
ENGINE_RNG = "rng.safetensors"

Engines = list[tuple[str, object, torch.optim.Optimizer]]
"""(model name, DeepSpeed engine, the torch optimizer it steps) of each trained model."""


def save_engine(path: str | Path, engines: Engines, group: Group, zero_stage: int, precision: str) -> None:
    """Write ``path/`` (module docstring); rank 0 writes, every rank gathers."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from learner.state.tree import rng_state

    rank = group.rank
    rng_tensors: dict[str, torch.Tensor] = {}
    rng = rng_state(rng_tensors)           # first: nothing below draws, but say so
    ranks_rng = group.gather([rng, {k: t.cpu().numpy().tobytes() for k, t in rng_tensors.items()}])
    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, int] = {}
    for prefix, engine, opt in engines:
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            values = {"fp32": safe_get_full_fp32_param(p)}
            for key in ADAM_STATES:
                values[key] = safe_get_full_optimizer_state(p, key)
            if rank == 0:
                for key, t in values.items():
                    tensors[f"{prefix}/{key}/{name}"] = t.detach().float().cpu().contiguous().clone()
        steps[prefix] = max((int(st["step"]) for st in opt.state.values() if "step" in st), default=0)
    if rank != 0:
        return
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ENGINE_TENSORS))
    save_file({f"rank{r}/{k}": torch.frombuffer(bytearray(b), dtype=torch.uint8)
               for r, (_, raw) in enumerate(ranks_rng) for k, b in raw.items()}, str(out / ENGINE_RNG))
    (out / ENGINE_JSON).write_text(json.dumps({"zero_stage": zero_stage, "world": group.world,
                                               "precision": precision, "adam_steps": steps,
                                               "rng": [state for state, _ in ranks_rng]}))


def load_engine(path: str | Path, engines: Engines, rank: int, zero_stage: int, seed: int) -> None:
    """Every rank: set this rank's partitions of the master weights and Adam moments, the model's
    own weights and the RNG states from ``path/``; ValueError when the files do not fit the model."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors.torch import load_file

    _init_adam_state(engines)
    src = Path(path)
    meta = json.loads((src / ENGINE_JSON).read_text())
    tensors = load_file(str(src / ENGINE_TENSORS))
    want = {f"{prefix}/{key}/{name}" for prefix, engine, _ in engines
            for name, p in engine.module.named_parameters() if p.requires_grad
            for key in ("fp32", *ADAM_STATES)}
    if set(tensors) != want:
        extra, missing = sorted(set(tensors) - want)[:2], sorted(want - set(tensors))[:2]
        raise ValueError(f"engine state does not fit: extra {extra}, missing {missing}")
    for prefix, engine, opt in engines:
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            t = tensors[f"{prefix}/fp32/{name}"]
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if tuple(t.shape) != shape:
                raise ValueError(f"engine tensor {name!r} has shape {tuple(t.shape)}, the model {shape}")
            safe_set_full_fp32_param(p, t.to(engine.device))
            for key in ADAM_STATES:
                safe_set_full_optimizer_state(p, tensors[f"{prefix}/{key}/{name}"].to(engine.device), key)
            if zero_stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                    if rank == 0:
                        p.data.copy_(t.to(p.dtype))
            else:
                with torch.no_grad():
                    p.data.copy_(t.to(p.dtype))
        for st in opt.state.values():
            if "step" in st:
                old, n = st["step"], meta["adam_steps"][prefix]
                st["step"] = (torch.tensor(float(n), dtype=old.dtype, device=old.device)
                              if torch.is_tensor(old) else n)
    _load_rng(src, meta, rank, seed)


def _init_adam_state(engines: Engines) -> None:
    """Before the first step torch's AdamW has no state (it makes it in its first step) and
    DeepSpeed has not linked its parameters to it: make both, as that first step would (zero
    moments), so a resume can set them."""
    for _, engine, opt in engines:
        flats = [p for group in opt.param_groups for p in group["params"]]
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            flats += list(getattr(engine.optimizer, name, None) or [])   # ZeRO-1/2, ZeRO-3
        for p in {id(p): p for p in flats}.values():
            st = opt.state[p]
            if "exp_avg" not in st:
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                          exp_avg_sq=torch.zeros_like(p))
        link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if callable(link):
            link()


def _load_rng(src: Path, meta: dict, rank: int, seed: int) -> None:
    """This rank's saved RNG states, or the :func:`learner.train.ds_group.rank_seed` rule for a
    rank the state has none of (learner.train.distributed, "RNG states per rank")."""
    from safetensors.torch import load_file

    from learner.state.tree import set_rng_state

    saved = meta.get("rng") or []
    if rank >= len(saved):
        seed_rank(seed, rank)
        return
    prefix = f"rank{rank}/"
    tensors = {k[len(prefix):]: t for k, t in load_file(str(src / ENGINE_RNG)).items()
               if k.startswith(prefix)}
    set_rng_state(saved[rank], tensors)
