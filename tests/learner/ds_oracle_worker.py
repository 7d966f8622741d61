"""One rank of the DeepSpeed rank checks (run by torchrun from test_deepspeed.py; not a test).

One process group runs several runs, one after another (a group costs a start-up of every rank:
sharing it keeps the test group short). Each run builds the DeepSpeed trainer on every rank, then

1. the oracle: rank 0 drives it as the service would (two steps, the second after a live config
   change, then a publish), the others run the real worker loop (:func:`serve`) until rank 0's
   ``stop``;
2. the rollback checks (every rank, in step: the strategy's ``_do_*`` bodies are the collectives): a step of
   several updates whose update ``at`` gets a NaN gradient on rank 1 only (``which``: policy or
   critic); every rank records whether its parameters, float32 masters and optimizer state are
   bit for bit what they were before the step, and how far update 1 had moved them;
3. the RNG checks (a run with ``rng``): every rank seeds its own RNGs apart, an engine state is
   saved, every rank draws (the uninterrupted draws), reseeds, loads it back and draws again; then
   it loads a one-rank engine state (``rng.one_rank``, made by the test) and draws.

Rank 0 writes everything to OUT_DIR/<run>.pt (torch.save of tensors, numbers and strings).

    torchrun --nproc_per_node 2 ds_oracle_worker.py MODEL_DIR OUT_DIR '{"runs": [...]}'
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE), str(HERE / "train"), str(HERE.parent / "ops")]

from config_kit import nested  # noqa: E402
from test_trainer import make_batch  # noqa: E402

from learner.config import (  # noqa: E402
    MOVED_KEYS,
    LearnerConfig,  # noqa: E402
    TrainerConfig,
    set_path,
)
from learner.train.distributed import make_trainer, serve  # noqa: E402
from learner.train.ds_group import batch_to_wire, join_group, master_weights  # noqa: E402
from learner.train.step import SkippedStep  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402

SECOND_STEP = {"batch.ppo_epochs": 1, "kl.coef": 0.0}
"""The live change before the oracle's second step (rank 0 sends the trainer's config with each step)."""


def oracle(tr: Trainer) -> dict | None:
    st = tr.strategy
    if st.rank != 0:
        serve(tr, st.group)
        return None
    stats = [tr.step(make_batch(seed=0))]
    for k, v in SECOND_STEP.items():
        set_path(tr.cfg, k, v)
    stats.append(tr.step(make_batch(seed=1)))
    tensors = {n: t.detach().float().cpu().clone() for n, t in tr.named_tensors()}
    tr.close()                                # the workers leave serve(); every rank goes on below
    return {"stats": stats, "tensors": tensors, "world": st.group.world, "gather": st.last_gather}


def engine_view(tr: Trainer) -> dict[str, torch.Tensor]:
    """Everything an update changes, as every rank sees it (collective under ZeRO-3): each trained
    parameter's full float32 master and Adam moments, this rank's own data of it (the ZeRO-3
    partition), and the optimizer's step counts."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for prefix, engine, opt in tr.strategy.engines():
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            out[f"{prefix}/fp32/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{prefix}/{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
            local = p.ds_tensor if hasattr(p, "ds_tensor") else p
            out[f"{prefix}/local/{name}"] = local.detach().cpu().clone()
        steps = [float(st["step"]) for st in opt.state.values() if "step" in st]
        out[f"{prefix}/adam_steps"] = torch.tensor(steps)
    return out


def poisoned_step(tr: Trainer, fields: dict, at: int, which: str, seed: int) -> dict:
    """One step (every rank) with ``fields`` set, whose update ``at`` backs a NaN through ``which``
    on rank 1 only; what it did to this rank's engine state."""
    st = tr.strategy
    before = engine_view(tr)
    masters_before = [t.clone() for _, e, _ in st.engines() for t in _masters(e)]
    seen = {"update": 0, "moved": 0.0}
    accumulate, backward = tr._accumulate, st.backward

    def counting(*a, **k):
        seen["update"] += 1
        if seen["update"] == at:                # what the earlier updates changed here
            now = [t for _, e, _ in st.engines() for t in _masters(e)]
            seen["moved"] = max(float((x - y).abs().max()) for x, y in zip(now, masters_before, strict=True))
        return accumulate(*a, **k)

    def poisoning(loss, w):
        if st.rank == 1 and seen["update"] == at and w == which:
            loss = loss * float("nan")
        return backward(loss, w)

    tr._accumulate, st.backward = counting, poisoning
    for key, value in fields.items():           # (flat names for short) on every rank's own config
        set_path(tr.cfg, MOVED_KEYS.get(key, key), value)
    try:
        st._do_step({}, batch_to_wire(make_batch(seed=seed)))
        reason, applied = "", -1.0
    except SkippedStep as e:
        reason, applied = str(e), float(e.stats["updates_applied_before_skip"])
    finally:
        del tr._accumulate, st.backward
    after = engine_view(tr)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    return {"reason": reason, "applied_before_skip": applied, "moved_before_skip": seen["moved"],
            "changed": changed, "compared": len(before)}


def _masters(engine) -> list[torch.Tensor]:
    return master_weights(engine)


def draw() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def rng_checks(tr: Trainer, out_dir: Path, one_rank: str) -> dict:
    st = tr.strategy
    r = st.rank
    torch.manual_seed(1000 + r)
    random.seed(2000 + r)
    np.random.seed(3000 + r)
    saved = out_dir / "engine-two-ranks"
    st._do_save_engine(str(saved))           # rank 0 writes it; the file system is shared
    st.group.gather(None)                    # a barrier: written before any rank reads it
    uninterrupted = draw()
    torch.manual_seed(7)                     # what a fresh process would have instead
    random.seed(7)
    np.random.seed(7)
    st._do_load_engine(str(saved))
    resumed = draw()
    st._do_load_engine(one_rank)
    from_one_rank = draw()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "from_one_rank": from_one_rank}


def main() -> int:
    model_dir, out_dir, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    group = None
    for run in spec["runs"]:
        cfg = LearnerConfig(**nested(run["fields"]))
        group = group or join_group(cfg.deepspeed)
        tr = make_trainer(TrainerConfig.of(cfg), model_dir, group)
        result = {"oracle": oracle(tr), "rank": tr.strategy.rank}
        result["rollback"] = [poisoned_step(tr, **p) for p in run.get("poison", [])]
        if run.get("rng"):
            result["rng"] = rng_checks(tr, out_dir, run["rng"]["one_rank"])
        every = group.gather(_plain(result))
        if group.rank == 0:
            torch.save({**result, "ranks": every}, out_dir / f"{run['name']}.pt")
    return 0


def _plain(result: dict) -> dict:
    """What each rank reports to rank 0 (msgpack: no tensors)."""
    return {"rollback": result["rollback"], "rng": result.get("rng")}


if __name__ == "__main__":
    sys.exit(main())
