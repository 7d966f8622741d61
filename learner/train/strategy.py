"""How a trainer's models are trained: the operations that differ between one process and a group
of data-parallel engines (docs/design.md §8). :class:`learner.train.trainer.Trainer` is given a
strategy and calls it; the trainer keeps everything else (the passes, advantages, losses and the
update loop's decisions: when to stop, skip or roll back).

    operation           PlainStrategy (one process)           DeepSpeedStrategy (learner.train.distributed)
    configure, wrap     the config as given; nothing          the rank's device, float32; the engines
    step                local_step here                       rank 0 sends the step to the others first
    share, sum_         every chunk, no dummy; as it is       chunks rank::N and dummies; all-reduce
    backward            loss.backward()                       engine.backward(loss × N)
    merge_minibatch     as measured                           gathered from every rank
    clip_grads          clip_grad_norm_ of each model         0, 0 (the engines clip inside their step)
    optimizer_steps     optimizer.step() of each model        engine.step(); raises skip() if skipped
    zero_grad           zero_grad(set_to_none=True)           the engines' overflow path
    snapshot, restore   trained parameters, optimizer state   this rank's partitions and masters too
    merge_log           as measured                           entropy, shortcut, sanity over ranks
    named_tensors       the parameters (or the adapter)       ZeRO-3: gathered bucket by bucket
    save_policy         save_pretrained                       ZeRO-3: gathered, written by rank 0
    model_state         policy, optimizers, reference, critic nothing (the engine state: engine/)
    engine state        none                                  save/load_engine_state (engine/)
    close               nothing                               rank 0 tells the other ranks to stop

A strategy serves one trainer: :meth:`TrainStrategy.wrap` binds it, after the trainer has built
its models and optimizers, and the strategy reads them there (``trainer.model``, ``.optimizer``,
``.critic``, ...). ``which`` names a model: ``policy`` or ``critic``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

import ops
from buffer import Batch
from learner.config import TrainerConfig
from learner.train.policy_io import load_policy_state, policy_state, publish_tensors, save_pretrained
from learner.train.step import MiniBatch, SkippedStep, StepPlan, UpdateLog

__all__ = ["PlainStrategy", "Skip", "TrainStrategy", "TrainerParts"]

Skip = Callable[[str], SkippedStep]
"""``skip(reason)``: the :class:`SkippedStep` (rollback done) an optimizer step raises when it
could not apply its update."""


class TrainerParts(Protocol):
    """What a strategy reads of the trainer it serves (:class:`learner.train.trainer.Trainer`
    has them; this module does not import it): the config, the models and optimizers the trainer
    built (None where it has none), and the step the strategy runs."""

    cfg: TrainerConfig
    tokenizer: Any
    model: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lora_config: Any
    reference: Any
    critic: Any
    critic_optimizer: torch.optim.Optimizer | None

    def local_step(self, batch: Batch) -> dict[str, float]:
        """One policy step of ``batch`` in this process."""
        ...


class TrainStrategy(Protocol):
    """The operations of the module docstring's table, as :class:`Trainer` calls them."""

    save_engine_state: Callable[[str | Path], None] | None
    """Write what the strategy keeps outside the model into a directory (a checkpoint's
    ``engine/``); None where it keeps nothing there."""
    load_engine_state: Callable[[str | Path], None] | None
    """Read it back (every rank); None where :attr:`save_engine_state` is."""

    def configure(self, cfg: TrainerConfig) -> TrainerConfig:
        """The config the trainer loads its models with (device, dtype)."""
        ...

    def wrap(self, trainer: TrainerParts) -> None:
        """Bind ``trainer`` once its models and optimizers exist (an engine may replace its
        ``critic`` and the model its ``forward`` runs)."""
        ...

    def step(self, batch: Batch) -> dict[str, float]:
        """``trainer.local_step(batch)``, after whatever the other processes need to run it too."""
        ...

    def share(self, chunks: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """(the row chunks this process computes, dummy passes to make) of a pass or mini-batch."""
        ...

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """A pass's output, with every other process's rows added in place."""
        ...

    def backward(self, loss: torch.Tensor, which: str) -> None:
        """Backward of one micro-batch's loss: gradients accumulate until the optimizer step."""
        ...

    def merge_minibatch(self, mb: MiniBatch) -> MiniBatch:
        """What a mini-batch measured, over every process that trained part of it."""
        ...

    def clip_grads(self, s: StepPlan) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(policy, critic) gradient norms before clipping, each model clipped once (0.0 where
        not trained here); tensors are read by the caller with the update's losses."""
        ...

    def optimizer_steps(self, s: StepPlan, gn: float, cn: float, skip: Skip) -> tuple[float, float]:
        """One optimizer step of the policy (when trained) and of the critic; the norms to report.
        Raises ``skip(reason)`` where an update could not be applied."""
        ...

    def broken_weights(self, s: StepPlan) -> str | None:
        """After an update: ``"policy"`` or ``"critic"`` when that model's trained weights are not
        finite (``ops.weights_finite``), else None. Under DeepSpeed every rank answers alike."""
        ...

    def zero_grad(self) -> None:
        """Drop every accumulated gradient."""
        ...

    def snapshot(self) -> object:
        """A copy of what an optimizer step changes (weights, optimizer state), for :meth:`restore`."""
        ...

    def restore(self, snap: object) -> None:
        """Put back what :meth:`snapshot` copied."""
        ...

    def merge_log(self, log: UpdateLog, shortcut: bool) -> None:
        """What every process's micro-batches recorded outside the mini-batches, merged into
        ``log`` (``shortcut``: the importance statistics and π_prox were made per micro-batch)."""
        ...

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What a publish sends (:meth:`Trainer.named_tensors`)."""
        ...

    def save_policy(self, path: Path) -> Path:
        """The policy directory (:meth:`Trainer.save_policy`)."""
        ...

    def model_state(self) -> dict:
        """The models' and optimizers' part of :meth:`Trainer.state_dict`."""
        ...

    def load_model_state(self, state: dict) -> None:
        """Load what :meth:`model_state` returned; ValueError when it does not fit the config."""
        ...

    def close(self) -> None:
        """The trainer is done: release what the strategy holds."""
        ...


class PlainStrategy:
    """One process: the trainer's torch models and AdamW optimizers, stepped as they are."""

    save_engine_state = None
    load_engine_state = None

    def __init__(self) -> None:
        self.trainer: TrainerParts | None = None

    def configure(self, cfg: TrainerConfig) -> TrainerConfig:
        return cfg

    def wrap(self, trainer: TrainerParts) -> None:
        self.trainer = trainer

    def step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.local_step(batch)

    # ---- inside a step -------------------------------------------------------------------------
    def share(self, chunks: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        return chunks, 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def backward(self, loss: torch.Tensor, which: str) -> None:
        loss.backward()

    def merge_minibatch(self, mb: MiniBatch) -> MiniBatch:
        return mb

    def clip_grads(self, s: StepPlan) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """Clip both models' gradients; their norms before clipping, as tensors (read by the
        caller with the update's losses: one device read)."""
        tr = self.trainer
        gn = cn = 0.0
        if s.train_policy:
            gn = torch.nn.utils.clip_grad_norm_(tr.trainable, tr.cfg.optimizer.max_grad_norm)
        if tr.critic is not None:
            cn = torch.nn.utils.clip_grad_norm_(tr.critic.parameters(), tr.cfg.critic.max_grad_norm)
        return gn, cn

    def optimizer_steps(self, s: StepPlan, gn: float, cn: float, skip: Skip) -> tuple[float, float]:
        if s.train_policy:
            self.trainer.optimizer.step()
        if self.trainer.critic is not None:
            self.trainer.critic_optimizer.step()
        return gn, cn

    def broken_weights(self, s: StepPlan) -> str | None:
        tr = self.trainer
        if s.train_policy and not ops.weights_finite(tr.trainable):
            return "policy"
        if tr.critic is not None and not ops.weights_finite(list(tr.critic.parameters())):
            return "critic"
        return None

    def zero_grad(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)
        if self.trainer.critic_optimizer is not None:
            self.trainer.critic_optimizer.zero_grad(set_to_none=True)

    def snapshot(self) -> dict:
        tr = self.trainer
        snap = {"policy": [p.detach().clone() for p in tr.trainable],   # frozen ones cannot change
                "optimizer": copy.deepcopy(tr.optimizer.state_dict())}
        if tr.critic is not None:
            snap["critic"] = [p.detach().clone() for p in tr.critic.parameters()]
            snap["critic_optimizer"] = copy.deepcopy(tr.critic_optimizer.state_dict())
        return snap

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        tr = self.trainer
        for p, saved in zip(tr.trainable, snap["policy"], strict=True):
            p.copy_(saved)
        tr.optimizer.load_state_dict(snap["optimizer"])
        if tr.critic is not None:
            for p, saved in zip(tr.critic.parameters(), snap["critic"], strict=True):
                p.copy_(saved)
            tr.critic_optimizer.load_state_dict(snap["critic_optimizer"])

    def merge_log(self, log: UpdateLog, shortcut: bool) -> None:
        return None

    # ---- publishing and checkpoints ----------------------------------------------------------
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return publish_tensors(self.trainer.model, lora=self.trainer.lora_config is not None)

    def save_policy(self, path: Path) -> Path:
        return save_pretrained(self.trainer.model, self.trainer.tokenizer, path)

    def model_state(self) -> dict:
        """Policy (the adapter alone under LoRA: the base is the loaded model, frozen) and its
        optimizer; the reference (empty under LoRA); the critic and its optimizer."""
        tr = self.trainer
        state = {"policy": policy_state(tr.model, lora=tr.lora_config is not None),
                 "optimizer": tr.optimizer.state_dict()}
        if tr.reference is not None:
            state["reference"] = tr.reference.state_dict()
        if tr.critic is not None:
            state["critic"] = tr.critic.state_dict()
            state["critic_optimizer"] = tr.critic_optimizer.state_dict()
        return state

    def load_model_state(self, state: dict) -> None:
        tr = self.trainer
        load_policy_state(tr.model, state["policy"], lora=tr.lora_config is not None)
        tr.optimizer.load_state_dict(state["optimizer"])
        for key, target in (("reference", tr.reference), ("critic", tr.critic)):
            if (key in state) != (target is not None):
                raise ValueError(f"checkpoint has {'a' if key in state else 'no'} {key}, "
                                 f"the config {'uses' if target is not None else 'does not use'} one")
            if target is not None:
                target.load_state_dict(state[key])
        if tr.critic is not None:
            tr.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def close(self) -> None:
        return None
