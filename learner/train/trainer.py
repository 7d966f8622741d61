"""The policy and one policy step (docs/design.md §4): the no-grad passes at the step's starting
weights, rewards, advantages, importance weights, then the updates.

    Trainer.step(batch)
      collate        samples -> right-padded tensors (learner.train.batching)
      reference      log π_ref, no grad                    when kl_coef > 0
      values         V of the critic at the start, no grad when advantage: gae
      proximal       log π_prox, no grad, model in eval    when the step needs it before its updates
      advantages     scores, KL in the reward, advantages, critic targets (learner.train.returns);
                     PF-PPO resampling; importance weights and M2PO masking
      update         ppo_epochs × mini-batches × micro-batches, gradients clipped once per
                     mini-batch, one optimizer step each (policy and critic, own lr and clip)

The proximal pass (when a step needs one, and the single-step shortcut where it does not), the
seeds' sanity check it makes possible, ``recompute_logprobs: false``, ``clip_anchor: behavior``,
and what a step that applies nothing restores: docs/design.md §4.

What differs between one process and data-parallel engines (backward, clipping and optimizer
steps, zeroing, who computes which micro-batches, rollback copies, publish gathers, checkpoint
state) is the trainer's :class:`learner.train.strategy.TrainStrategy`: :class:`PlainStrategy`
unless it is given another (:class:`learner.train.distributed.DeepSpeedStrategy`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ops
from buffer import Batch
from learner.config import TrainerConfig
from learner.models.forward import LogprobForward
from learner.train.batching import BatchTensors, collate, plan_updates, take
from learner.train.critic import Critic
from learner.train.devices import resolve_runtime
from learner.train.dropout import disable_dropout
from learner.train.policy_io import adamw, attn_kwargs, load_policy, lora_publish_fields
from learner.train.reference import ReferencePolicy
from learner.train.returns import advantages_and_targets, sequence_scores, token_rewards
from learner.train.schedules import lr_factor
from learner.train.step import (
    PHASES,
    BrokenWeights,
    MiniBatch,
    Passes,
    Phases,
    Returns,
    SkippedStep,
    StepPlan,
    StepRows,
    UpdateInputs,
    UpdateLog,
    Weights,
    step_stats,
)
from learner.train.strategy import PlainStrategy, TrainStrategy
from protocol import LoraSpec

ROLLBACK_AUTO_PARAMS = 300_000_000
"""``algorithm.rollback_nonfinite: null`` keeps a pre-step copy up to this many trained parameters."""

__all__ = ["FLAGGED_IS_MODE", "PHASES", "BatchTensors", "BrokenWeights", "SkippedStep", "Trainer", "collate"]

FLAGGED_IS_MODE = "tis"
"""Importance-weight mode of samples flagged ``needs_correction`` when ``is_mode`` is ``none``."""


class Trainer:
    """Owns the policy model, its tokenizer and optimizer; the reference and the critic when the
    config uses them.

    Device and dtype: ``learner.runtime.device`` / ``learner.runtime.dtype`` (:mod:`learner.train.devices`). The weights
    are held and updated in that dtype (bfloat16: no float32 master copy, so an update smaller than
    about 1/256 of a weight rounds away; LoRA adapters stay float32, PEFT's default); batches are
    collated on the CPU and moved to the device; log-probs, entropies and all of ``ops`` compute in
    float32; every returned statistic is a Python float.

    LoRA (``learner.lora``): the policy is wrapped by PEFT and only the adapter's parameters are
    trained (and in the optimizer); the reference is the base with the adapter disabled; a publish
    (:meth:`named_tensors`) carries the adapter's tensors under ``get_peft_model_state_dict`` names,
    with :meth:`publish_lora` the adapter config.

    ``strategy``: how the models are trained (module docstring); it may change the config the
    models load with (DeepSpeed: the rank's device, float32) and wraps them once they are built.
    """

    def __init__(self, cfg: TrainerConfig, model_path: str, strategy: TrainStrategy | None = None):
        if not isinstance(cfg, TrainerConfig):
            raise TypeError("Trainer takes a TrainerConfig (its sections of the learner's config: "
                            f"TrainerConfig.of(learner_config)), not {type(cfg).__name__}")
        self.strategy: TrainStrategy = strategy if strategy is not None else PlainStrategy()
        cfg = self.strategy.configure(cfg)
        self.cfg = cfg
        self.runtime = resolve_runtime(cfg.runtime)    # device, weights' dtype, autocast, and why
        self.device, self.dtype, self.autocast = self.runtime.device, self.runtime.dtype, self.runtime.autocast
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tokenizer, model, self.lora_config = load_policy(cfg, model_path, self.dtype, self.device)
        self.model = model
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        rollback = cfg.algorithm.rollback_nonfinite
        self.rollback_nonfinite = rollback if rollback is not None else (
            self.lora_config is not None or sum(p.numel() for p in self.trainable) <= ROLLBACK_AUTO_PARAMS)
        """A copy before each step to roll a broken update back to (algorithm.rollback_nonfinite)."""
        self.optimizer = adamw(self.trainable, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
        self.forward = LogprobForward(self.model, autocast=self.autocast)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        # Rows of the input embedding: every token id of a trained sample must be below it (the
        # learner validates results against it before accepting them).
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings
        self.reference: ReferencePolicy | None = None
        if cfg.kl.uses_reference:
            if cfg.lora is not None:
                self.reference = ReferencePolicy.adapter_disabled(self.model, autocast=self.autocast)
            else:
                self.reference = ReferencePolicy.copy_of(self.model, "cpu" if cfg.kl.reference_on_cpu else None,
                                                         autocast=self.autocast)
        self.critic: Critic | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if cfg.algorithm.uses_critic:
            self.critic = Critic(cfg.critic.model or model_path, dtype=self.dtype,
                                 **attn_kwargs(cfg.runtime.attn_implementation))
            if cfg.runtime.disable_dropout:
                disable_dropout(self.critic)
            self.critic.to(self.device)
            if cfg.runtime.gradient_checkpointing:
                self.critic.backbone.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            self.critic.train()
            self.critic_optimizer = adamw(self.critic.parameters(), lr=cfg.critic.lr,
                                          weight_decay=cfg.optimizer.weight_decay)
        if cfg.kl.controller == "adaptive":
            self.kl_controller = ops.AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
        else:
            self.kl_controller = ops.FixedKLController(cfg.kl.coef)
        self.reward_moments = ops.RunningMoments()
        self.strategy.wrap(self)

    # ---- what the service uses -------------------------------------------------------------
    def encode_prompt(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return np.asarray(ids, dtype=np.int32)

    @property
    def publish_kind(self) -> str:
        """``lora`` (adapter tensors only) or ``full`` — the manifests' ``kind``."""
        return "lora" if self.lora_config is not None else "full"

    def publish_lora(self) -> LoraSpec | None:
        """The adapter a LoRA publish's manifest carries (``WeightsAvailable.lora``): the
        ``LoraConfig`` fields of :data:`LORA_PUBLISH_FIELDS` (target modules as PEFT resolved them,
        e.g. ``all-linear`` -> the module names, sorted); None for full weights."""
        return None if self.lora_config is None else lora_publish_fields(self.model)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What a publish sends. Full: every parameter in the training dtype, tied parameters once
        (``named_parameters`` yields a shared tensor under its first name only, e.g. the embedding
        and not ``lm_head.weight``; both engines re-tie on load). LoRA: the adapter's tensors
        under ``get_peft_model_state_dict`` names (``base_model.model.<module>.lora_A.weight``).
        Collective under ZeRO-3 (gathered from the ranks' partitions; [] on the other ranks)."""
        return self.strategy.named_tensors()

    def save_policy(self, path: str | Path) -> Path:
        """``save_pretrained`` of the policy — the full model in the training dtype, or the PEFT
        adapter (``adapter_config.json`` + ``adapter_model.safetensors``, which transformers with
        PEFT, PEFT itself and vLLM's ``LoRARequest`` load as they are) — and the tokenizer
        (ZeRO-3: gathered, written by rank 0)."""
        return self.strategy.save_policy(Path(path))

    def close(self) -> None:
        """Done with this trainer (DeepSpeed: rank 0 tells the other ranks to exit)."""
        self.strategy.close()

    # ---- checkpoints (learner.state.checkpoint) --------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resume needs besides the config and :attr:`save_engine_state`: the
        strategy's models and optimizers (plain: policy — the adapter alone under LoRA —, its
        optimizer, reference, critic and its optimizer; DeepSpeed: none), the KL controller and
        the running reward moments (plain tensors and numbers)."""
        return {**self.strategy.model_state(), "kl_controller": self.kl_controller.state_dict(),
                "reward_moments": self.reward_moments.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_model_state(state)
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.reward_moments.load_state_dict(state["reward_moments"])

    @property
    def save_engine_state(self):
        """The strategy's writer of the state it keeps outside the model (DeepSpeed: the engines'
        master weights, Adam moments and every rank's RNG states), or None: a checkpoint then
        holds the policy directory and :meth:`state_dict` alone."""
        return self.strategy.save_engine_state

    @property
    def load_engine_state(self):
        """Its reader (every rank), or None: a resume loads the policy directory."""
        return self.strategy.load_engine_state

    # ---- passes ----------------------------------------------------------------------------
    def _logprobs(self, sub: BatchTensors, entropy: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log π (b, L-1), entropy (b, L-1) or None) of the policy; the same function in every
        pass (learner.models.forward), so a no-grad pass and a gradient forward agree bit for bit."""
        return self.forward(sub.input_ids, sub.attention_mask, sub.targets, sub.temperatures,
                            entropy=entropy)

    @torch.no_grad()
    def _no_grad_pass(self, bt: BatchTensors, chunks: list[torch.Tensor], fn) -> torch.Tensor:
        """``fn(sub)`` -> (b, L_sub-1) over the row chunks, gathered into a (B, L-1) tensor. Each
        process computes its share of the chunks (and dummy passes on the first, so that every
        rank makes the same passes); the rows are disjoint, so the sum over ranks is each row's."""
        mine, dummies = self.strategy.share(chunks)
        out = torch.zeros(bt.mask.shape, dtype=torch.float32, device=bt.mask.device)
        for rows in mine:
            sub = bt.rows(rows)
            out[rows, :sub.mask.shape[1]] = fn(sub).float()
        for _ in range(dummies):
            fn(bt.rows(chunks[0]))
        return self.strategy.sum_(out)

    def _proximal_pass(self, bt: BatchTensors, chunks: list[torch.Tensor]) -> torch.Tensor:
        """log π at the current weights, no grad, in eval mode (dropout off whatever the config)."""
        self.model.eval()
        try:
            return self._no_grad_pass(bt, chunks, lambda s: self._logprobs(s)[0])
        finally:
            self.model.train()

    def _values_pass(self, bt: BatchTensors, chunks: list[torch.Tensor]) -> torch.Tensor:
        self.critic.eval()
        try:
            return self._no_grad_pass(bt, chunks, lambda s: self.critic(s.input_ids, s.attention_mask))
        finally:
            self.critic.train()

    def _reference_pass(self, bt: BatchTensors, chunks: list[torch.Tensor]) -> torch.Tensor:
        return self._no_grad_pass(bt, chunks, lambda s: self.reference.logprobs(
            s.input_ids, s.attention_mask, s.targets, s.temperatures))

    def _importance(self, proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor,
                    flagged: torch.Tensor, any_flagged: bool) -> tuple[torch.Tensor, torch.Tensor, list[tuple[dict, Any]]]:
        """Behavior weights of some rows -> (weights (b, L-1), kept mask, [(is_stats, tokens), ...]).

        Rows flagged ``needs_correction`` under ``is_mode: none`` get ``FLAGGED_IS_MODE`` with
        ``is_cap``; every other row gets ``is_mode``. Each row is weighed once; every mode is
        row-local, so weighing the two sets of rows apart gives each row what the whole batch
        would. Tokens that ``mis`` / ``seq_mis`` / ``geo_mis`` reject have weight 0. The statistics
        and their token counts stay tensors (read with the step's, ``ops.read_tensors``);
        ``any_flagged`` says whether ``flagged`` has a row (known on the host: no device read).
        """
        cfg = self.cfg
        if cfg.algorithm.is_mode != "none" or not any_flagged:
            w, keep, st = ops.importance_weights(proximal, behavior, mask, mode=cfg.algorithm.is_mode,
                                                 cap=cfg.algorithm.is_cap, veto=cfg.algorithm.is_veto,
                                                 bounds=(cfg.algorithm.icepop_low, cfg.algorithm.icepop_high))
            return w, keep, [(st, (mask != 0).sum())]
        weights = torch.zeros_like(proximal)                                       # (b, L-1)
        keep = torch.zeros_like(mask)
        parts = []
        for rows, mode in ((~flagged, "none"), (flagged, FLAGGED_IS_MODE)):
            if not bool(rows.any()):
                continue
            w, k, st = ops.importance_weights(proximal[rows], behavior[rows], mask[rows], mode=mode,
                                              cap=cfg.algorithm.is_cap, veto=cfg.algorithm.is_veto)
            weights[rows] = w.to(weights.dtype)
            keep[rows] = k
            parts.append((st, (mask[rows] != 0).sum()))
        return weights, keep, parts

    def _set_learning_rates(self, version: int) -> tuple[float, float]:
        cfg = self.cfg
        lr = cfg.optimizer.lr * lr_factor(cfg.optimizer.lr_schedule, version, cfg.optimizer.lr_warmup_steps, cfg.total_steps,
                                cfg.optimizer.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        critic_lr = 0.0
        if self.critic_optimizer is not None:
            critic_lr = cfg.critic.lr * lr_factor(cfg.critic.lr_schedule, version,
                                                  cfg.critic.lr_warmup_steps, cfg.total_steps,
                                                  cfg.optimizer.min_lr_ratio)
            for g in self.critic_optimizer.param_groups:
                g["lr"] = critic_lr
        return lr, critic_lr

    # ---- the step --------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, float]:
        """One policy step on a batch whose groups are contiguous and complete (module docstring).

        Within a mini-batch, micro-batches of ``micro_batch_samples`` rows accumulate gradients;
        each micro-batch loss is divided by ``ops.loss_normalizer`` of the whole mini-batch's
        mask, so their sum is the mini-batch loss and the gradients do not depend on the split.
        Tokens that ``mis`` / ``seq_mis`` / ``geo_mis`` / M2PO reject get weight 0 and keep their
        place in every denominator (the token count, the per-row means), as in AReaL's decoupled
        loss: a rejected token is not trained, and does not raise the weight of the others.

        Correction of samples flagged ``needs_correction`` (over ``max_staleness`` under
        ``stale_policy: correct``): they always get behavior importance weights w = π_prox/μ —
        ``is_mode`` when it is not ``none``, and ``tis`` capped at ``is_cap`` when it is (a sample the
        operator asked to correct is corrected; truncation rather than masking keeps every one of
        its tokens in the batch, as the flag promises to train it). Their proximal log-probs are
        always the current weights', even under ``recompute_logprobs: false``, since π_prox := μ
        would make every weight 1. Unflagged samples train exactly as without the flag.

        Statistics are those of the whole batch: importance weights (``is_*``, ``mismatch_kl``)
        once per row; ``pg_*`` over every applied update's micro-batches, combined by
        ``ops.merge_stats``; entropy over the first epoch's forwards. Raises :class:`SkippedStep`
        when a loss or gradient is not finite (nothing applied).

        The strategy runs :meth:`local_step` (under DeepSpeed rank 0 first sends the batch and the
        live config to the other ranks, which run it too).
        """
        return self.strategy.step(batch)

    def local_step(self, batch: Batch) -> dict[str, float]:
        """:meth:`step` in this process (every rank of a group runs it on the whole batch). The
        phases, each a method whose inputs and outputs are its signature (learner.train.step)."""
        phases = Phases()
        start = time.monotonic()
        with phases("collate"):
            s, rows = self._plan(batch)
        passes = self._no_grad_passes(s, rows, phases)
        with phases("advantages"):
            rows, passes, returns = self._advantages(s, rows, passes)
        weights = self._proximal_and_weights(s, rows, passes, phases)
        x = UpdateInputs(rows=rows, passes=passes, returns=returns, weights=weights)
        with phases("update"):
            log = self._update(s, x, start)
            self.strategy.merge_log(log, shortcut=weights.proximal is None)
        # The step's statistics still on the device, read at once (learner.train.step).
        ref_kl = self._reference_kl(s, x, log) if s.use_kl else None
        on_device = {"score_mean": returns.scores.mean(),
                     "advantage_abs_mean": ops.masked_mean(returns.adv.abs(), rows.bt.mask)}
        on_device, ref_kl = log.read(on_device, ref_kl)
        kl_next = self.kl_controller.update(ref_kl[1], len(rows.bt)) if s.use_kl else 0.0
        stats = step_stats(self.cfg, batch, s, log, x=x, ref_kl=ref_kl, kl_next=kl_next,
                           critic=self.critic is not None, read=on_device)
        stats.update({f"time_{name}_s": sec for name, sec in phases.seconds.items()})
        stats["step_s"] = time.monotonic() - start
        return stats

    def _plan(self, batch: Batch) -> tuple[StepPlan, StepRows]:
        """Collate, check, and decide what this step computes."""
        cfg = self.cfg
        B = len(batch.samples)
        if B == 0:
            raise ValueError("Trainer.step: empty batch")
        flags = list(batch.needs_correction) or [False] * B
        if len(flags) != B:
            raise ValueError(f"Trainer.step: {len(flags)} needs_correction flags for {B} samples")
        bt = collate(batch.samples, self.pad_id, cfg.sampling.temperature)
        low, top = int(bt.input_ids.min()), int(bt.input_ids.max())
        if low < 0 or top >= self.vocab_size:   # the learner refuses such results; never index past
            bad = low if low < 0 else top
            raise ValueError(f"Trainer.step: token id {bad} outside the vocabulary [0, {self.vocab_size})")
        bt = bt.to(self.device)
        version, any_flagged = int(batch.version), any(flags)
        lr, critic_lr = self._set_learning_rates(version)
        train_policy = self.critic is None or version >= cfg.critic.warmup_steps
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + version)
        mini = cfg.batch.mini_batch_samples if 0 < cfg.batch.mini_batch_samples < B else B
        n_updates = cfg.batch.ppo_epochs * -(-B // mini)
        beta = self.kl_controller.value
        use_kl = self.reference is not None and beta > 0
        # Rows whose proximal log-probs must be the current weights' (all, or the flagged ones).
        current_rows = cfg.algorithm.recompute_logprobs or any_flagged
        needed_early = (use_kl and cfg.kl.in_reward) or (self.critic is not None and cfg.critic.targets == "vtrace")
        separate = current_rows and (needed_early or (train_policy and (
            n_updates > 1 or cfg.algorithm.m2po_threshold is not None)))
        every = cfg.algorithm.sanity_every
        sanity_on = cfg.algorithm.recompute_logprobs and train_policy and (
            separate or (every > 0 and version % every == 0))
        s = StepPlan(version=version, lr=lr, critic_lr=critic_lr, train_policy=train_policy,
                     generator=generator, mini=mini, n_updates=n_updates, beta=beta, use_kl=use_kl,
                     group_sizes=list(batch.group_sizes) or [cfg.batch.group_size] * (B // cfg.batch.group_size),
                     current_rows=current_rows, needed_early=needed_early, separate=separate,
                     sanity_on=sanity_on, sanity_pass=sanity_on and not separate,
                     moments_before=self.reward_moments.state_dict())
        plan = []
        if cfg.reward.batch_filter != "pf_ppo":     # else drawn on the resampled batch (_advantages)
            plan = plan_updates(B, cfg.batch.ppo_epochs, mini, cfg.batch.micro_batch_samples, generator,
                                bt.seq_lens, cfg.batch.micro_batch_tokens)
        flagged = torch.tensor(flags, dtype=torch.bool, device=self.device)
        truncated = tuple(smp.finish_reason == "length" for smp in batch.samples)
        return s, StepRows(bt=bt, flagged=flagged, any_flagged=any_flagged, plan=plan, truncated=truncated)

    @staticmethod
    def _first_micro_batches(rows: StepRows) -> list[torch.Tensor]:
        """The micro-batches of the first epoch, in order (the first mini-batch's come first)."""
        return [r for mb in rows.plan[0] for r in mb]

    def _proximal_of(self, rows: StepRows, pass_lp: torch.Tensor) -> torch.Tensor:
        if self.cfg.algorithm.recompute_logprobs:
            return pass_lp
        return torch.where(rows.flagged[:, None], pass_lp, rows.bt.behavior_logprobs)

    def _no_grad_passes(self, s: StepPlan, rows: StepRows, phases: Phases) -> Passes:
        """Reference log-probs, critic values and (when the advantages need it) the proximal pass,
        all at the step's starting weights, over the first epoch's micro-batches (the batch's
        order before a PF-PPO resampling, which draws the plan afterwards)."""
        bt = rows.bt
        chunks = (self._first_micro_batches(rows) if rows.plan
                  else list(torch.arange(len(bt)).split(self.cfg.batch.micro_batch_samples)))
        ref_lp = old_values = prox_pass = None
        if s.use_kl:
            with phases("reference"):
                ref_lp = self._reference_pass(bt, chunks)                         # (B, L-1)
        if self.critic is not None:
            with phases("values"):
                old_values = self._values_pass(bt, chunks)                        # (B, L-1)
        if s.separate and (s.needed_early or self.cfg.reward.batch_filter == "pf_ppo"):
            with phases("proximal"):
                prox_pass = self._proximal_pass(bt, chunks)
        return Passes(ref_lp=ref_lp, old_values=old_values, prox_pass=prox_pass)

    def _advantages(self, s: StepPlan, rows: StepRows, passes: Passes) -> tuple[StepRows, Passes, Returns]:
        """Scores, per-token rewards, advantages and critic targets (learner.train.returns); then the
        PF-PPO resampling (new rows and passes) and its update plan."""
        cfg, bt = self.cfg, rows.bt
        early_prox = None
        if passes.prox_pass is not None:
            early_prox = self._proximal_of(rows, passes.prox_pass)
        elif not s.current_rows:
            early_prox = bt.behavior_logprobs
        scores = sequence_scores(cfg, bt.rewards, bt.lengths, self.reward_moments)   # (B,)
        kl_tok = None
        if s.use_kl and cfg.kl.in_reward:
            kl_tok = ops.kl_estimate(early_prox, passes.ref_lp, cfg.kl.kind)       # (B, L-1)
        rewards_t = token_rewards(scores, bt.mask, kl_tok, s.beta)                  # (B, L-1)
        adv, targets = advantages_and_targets(cfg, rewards_t, bt.mask, s.group_sizes, passes.old_values,
                                              bt.behavior_logprobs, early_prox)
        filter_stats = {}
        if cfg.reward.mask_truncated:
            # DAPO's overlong filtering: the advantages above counted every reward of each group;
            # from here on a truncated row has no token in the loss (nor in its denominators).
            cut = torch.tensor(rows.truncated, dtype=torch.bool, device=bt.mask.device)
            filter_stats["truncated_masked_samples"] = float(sum(rows.truncated))
            if any(rows.truncated):
                bt = dataclasses.replace(bt, mask=torch.where(cut[:, None], torch.zeros_like(bt.mask), bt.mask))
                rows = dataclasses.replace(rows, bt=bt)
        if cfg.reward.batch_filter != "pf_ppo":
            return rows, passes, Returns(scores=scores, rewards_t=rewards_t, adv=adv, targets=targets,
                                         filter_stats=filter_stats)
        B = len(bt)
        w = ops.pf_ppo_weights(rewards_t.sum(dim=-1), cfg.reward.pf_ppo_method, cfg.reward.pf_ppo_weight_pow)
        idx = ops.pf_ppo_resample(w.cpu(), B, generator=s.generator)               # (B,) CPU generator

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]
        bt = bt.select(idx)
        plan = plan_updates(B, cfg.batch.ppo_epochs, s.mini, cfg.batch.micro_batch_samples, s.generator,
                            bt.seq_lens, cfg.batch.micro_batch_tokens)
        rows = StepRows(bt=bt, flagged=rows.flagged[idx], any_flagged=rows.any_flagged, plan=plan,
                        truncated=tuple(rows.truncated[i] for i in idx.tolist()))
        passes = Passes(ref_lp=pick(passes.ref_lp), old_values=pick(passes.old_values),
                        prox_pass=pick(passes.prox_pass))
        return rows, passes, Returns(scores=scores, rewards_t=rewards_t[idx], adv=adv[idx], targets=pick(targets),
                                     filter_stats={**filter_stats,
                                                   "pf_ppo_unique_fraction": len(set(idx.tolist())) / B})

    def _proximal_and_weights(self, s: StepPlan, rows: StepRows, passes: Passes, phases: Phases) -> Weights:
        """The proximal pass over the first mini-batch's micro-batches (when it has not run yet),
        then the importance weights and the M2PO mask of the whole batch, where π_prox is known
        before the updates (the shortcut computes them per micro-batch instead)."""
        cfg, bt = self.cfg, rows.bt
        prox_pass = passes.prox_pass
        if s.separate and prox_pass is None:
            with phases("proximal"):
                prox_pass = self._proximal_pass(bt, self._first_micro_batches(rows))
        sanity = sanity_rows = None
        if s.sanity_pass:                 # the check's own pass: the first micro-batch only
            sanity_rows = self._first_micro_batches(rows)[0]
            with phases("proximal"):
                sanity = self._proximal_pass(bt, [sanity_rows])
        with phases("advantages"):
            proximal = None
            if prox_pass is not None:
                proximal = self._proximal_of(rows, prox_pass)
            elif not s.current_rows:
                proximal = bt.behavior_logprobs
            if proximal is None or not s.train_policy:
                return Weights(proximal=proximal, sanity=sanity, sanity_rows=sanity_rows)
            weights, kept, is_parts = self._importance(proximal, bt.behavior_logprobs, bt.mask,
                                                       rows.flagged, rows.any_flagged)
            m2po_stats: dict = {}
            if cfg.algorithm.m2po_threshold is not None:
                keep, m2po_stats = ops.m2po_mask(proximal, bt.behavior_logprobs, kept, cfg.algorithm.m2po_threshold)
                weights = torch.where(keep, weights, torch.zeros_like(weights))
            return Weights(proximal=proximal, weights=weights, is_parts=tuple(is_parts), m2po_stats=m2po_stats)

    def _update(self, s: StepPlan, x: UpdateInputs, start: float) -> UpdateLog:
        """ppo_epochs × mini-batches: accumulate, check, clip, step (or stop, or skip the step)."""
        cfg, proximal = self.cfg, x.weights.proximal
        log = UpdateLog(filled=torch.zeros_like(x.rows.bt.mask) if proximal is None else proximal,
                        is_parts=list(x.weights.is_parts))
        snapshot = None
        for epoch, minibatches in enumerate(x.rows.plan):
            for m, micros in enumerate(minibatches):
                mb = self._accumulate(s, x, log, micros, epoch, first=(epoch == 0 and m == 0))
                if (cfg.algorithm.target_kl is not None and s.train_policy and log.applied > 0
                        and ops.merge_stats(mb.pg_parts)["approx_kl"] > cfg.algorithm.target_kl):
                    log.early_stopped = True               # this mini-batch's gradients are dropped
                    self.strategy.zero_grad()
                    return log
                where = f"update {log.applied + 1} of {s.n_updates}"
                # The update's one device read: its loss terms and both gradient norms (the clip
                # scales non-finite gradients too; a skip then restores and zeroes them anyway).
                gn, cn = mb.read(*self.strategy.clip_grads(s))
                bad = next((name for name in sorted(mb.losses, key=lambda n: n != "loss")
                            if not math.isfinite(mb.losses[name])), None)   # the total first
                if bad is not None:
                    raise self._skip(s, snapshot, log, f"non-finite {bad} at {where}", start)
                for which, norm in (("policy", gn), ("critic", cn)):
                    if not math.isfinite(norm):
                        raise self._skip(s, snapshot, log, f"non-finite {which} gradient norm at {where}", start)
                if snapshot is None and (s.n_updates > 1 or self.rollback_nonfinite):
                    snapshot = self.strategy.snapshot()     # before the first optimizer step
                gn, cn = self.strategy.optimizer_steps(s, gn, cn, lambda reason, snap=snapshot, at=where: self._skip(
                    s, snap, log, f"{reason} at {at}", start))
                broken = self.strategy.broken_weights(s)
                if broken is not None:                     # never published nor checkpointed
                    if snapshot is None:
                        raise BrokenWeights(f"non-finite {broken} weights after {where} (no copy to roll "
                                            "back to: algorithm.rollback_nonfinite is off)")
                    raise self._skip(s, snapshot, log, f"non-finite {broken} weights after {where} "
                                     "(rolled back)", start)
                if s.train_policy:
                    log.grad_norms.append(gn)
                    log.pg_parts.extend(mb.pg_parts)
                if self.critic is not None:
                    log.critic_grad_norms.append(cn)
                    log.vf_parts.extend(mb.vf_parts)
                for k, v in mb.losses.items():
                    log.losses.setdefault(k, []).append(v)
                log.applied += 1
        return log

    def _skip(self, s: StepPlan, snapshot: object | None, log: UpdateLog, reason: str,
              start: float) -> SkippedStep:
        """Undo what this step changed and say why (raised by the caller)."""
        if snapshot is not None:
            self.strategy.restore(snapshot)
        self.reward_moments.load_state_dict(s.moments_before)
        self.strategy.zero_grad()
        return SkippedStep(reason, {"updates_applied_before_skip": float(log.applied),
                                    "step_s": time.monotonic() - start})

    def _accumulate(self, s: StepPlan, x: UpdateInputs, log: UpdateLog, micros: list[torch.Tensor],
                    epoch: int, first: bool) -> MiniBatch:
        """Forward and backward of one mini-batch's micro-batches (gradients accumulate): this
        process's share of them, then its dummy passes."""
        cfg, bt = self.cfg, x.rows.bt
        normalizer = ops.loss_normalizer(bt.mask[torch.cat(micros)], cfg.algorithm.loss_agg,
                                         cfg.algorithm.loss_norm_tokens or cfg.sampling.max_new_tokens)
        self.strategy.zero_grad()
        mb = MiniBatch()
        mine, dummies = self.strategy.share(micros)
        for rows in mine:
            sub = bt.rows(rows)
            L = sub.input_ids.shape[1]
            mask = sub.mask
            n_tok = (mask != 0).sum()                    # a tensor, read with the step's statistics
            if s.train_policy:
                self._policy_micro(s, x, log, mb, sub, rows, normalizer, n_tok, epoch, first)
            if self.critic is not None:
                values = self.critic(sub.input_ids, sub.attention_mask)               # (b, L-1)
                vf_loss, vf_stats = ops.value_loss(
                    values, take(x.passes.old_values, rows, L), take(x.returns.targets, rows, L), mask,
                    clip=cfg.critic.value_clip, agg=cfg.algorithm.loss_agg, normalizer=normalizer)
                self.strategy.backward(vf_loss, "critic")
                mb.add("vf_loss", vf_loss)
                mb.vf_parts.append((vf_stats, n_tok))
        for _ in range(dummies):
            self._dummy_micro(s, bt, micros[0])
        return self.strategy.merge_minibatch(mb)

    def _dummy_micro(self, s: StepPlan, bt: BatchTensors, rows: torch.Tensor) -> None:
        """A pass with a zero loss: the same collectives as a real micro-batch, no gradient."""
        sub = bt.rows(rows)
        if s.train_policy:
            lp, _ = self._logprobs(sub, "none")
            self.strategy.backward(lp.sum() * 0.0, "policy")
        if self.critic is not None:
            self.strategy.backward(self.critic(sub.input_ids, sub.attention_mask).sum() * 0.0, "critic")

    def _policy_micro(self, s: StepPlan, x: UpdateInputs, log: UpdateLog, mb: MiniBatch, sub: BatchTensors,
                      rows: torch.Tensor, normalizer: float, n_tok: int, epoch: int, first: bool) -> None:
        """The policy's forward and backward on one micro-batch."""
        cfg, w8 = self.cfg, x.weights
        L = sub.input_ids.shape[1]
        mask, behavior = sub.mask, sub.behavior_logprobs
        logprobs, entropy = self._logprobs(sub, "grad" if cfg.algorithm.entropy_coef > 0 else "stat")  # (b, L-1)
        if epoch == 0:
            log.entropy_parts.append((ops.masked_sum(entropy.detach(), mask), mask.sum()))
        current = logprobs.detach()
        flagged = x.rows.flagged
        if w8.proximal is None:                                     # the single-step shortcut
            prox = current if cfg.algorithm.recompute_logprobs else torch.where(flagged[rows, None], current, behavior)
            log.filled[rows, :L - 1] = prox
            w, _, parts = self._importance(prox, behavior, mask, flagged[rows], x.rows.any_flagged)
            log.is_parts.extend(parts)
        else:
            prox, w = take(w8.proximal, rows, L), take(w8.weights, rows, L)
        if first and s.sanity_on:
            if w8.proximal is not None:
                log.sanity.add(current, prox, mask)
            elif w8.sanity_rows is not None and torch.equal(rows, w8.sanity_rows):
                log.sanity.add(current, take(w8.sanity, rows, L), mask)
        anchor = prox
        if cfg.algorithm.clip_anchor == "behavior":       # the trust region around the sampler (config doc)
            w, anchor = ops.behavior_anchored_weights(w, prox, behavior, mask), behavior
        pg_loss, pg_stats = self._policy_loss(logprobs, anchor, take(x.returns.adv, rows, L), mask, w, normalizer)
        total = pg_loss
        mb.add("pg_loss", pg_loss)
        if s.use_kl and not cfg.kl.in_reward:
            kl_val, _ = ops.kl_loss(logprobs, take(x.passes.ref_lp, rows, L), mask, cfg.kl.kind, cfg.algorithm.loss_agg,
                                    normalizer)
            total = total + s.beta * kl_val
            mb.add("kl_loss", kl_val)
        if cfg.algorithm.entropy_coef > 0:
            ent_val, _ = ops.entropy_loss(entropy, mask, cfg.algorithm.loss_agg, normalizer)
            total = total - cfg.algorithm.entropy_coef * ent_val
            mb.add("entropy_bonus", ent_val)
        self.strategy.backward(total, "policy")
        mb.add("loss", total)
        mb.pg_parts.append((pg_stats, n_tok))

    def _policy_loss(self, logprobs: torch.Tensor, anchor: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     w: torch.Tensor, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured policy loss (``algorithm.policy_loss``) of one micro-batch -> (loss, stats)."""
        alg = self.cfg.algorithm
        common = dict(clip_low=alg.clip_low, clip_high=alg.clip_high, is_weights=w, agg=alg.loss_agg,
                      normalizer=normalizer)
        if alg.policy_loss == "gspo":
            return ops.gspo_policy_loss(logprobs, anchor, adv, mask, **common)
        if alg.policy_loss == "cispo":
            return ops.cispo_policy_loss(logprobs, anchor, adv, mask, **common)
        return ops.ppo_policy_loss(logprobs, anchor, adv, mask, dual_clip=alg.dual_clip, **common)

    def _reference_kl(self, s: StepPlan, x: UpdateInputs, log: UpdateLog) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token mean, per-sample sum mean) of the KL estimate between the step's starting
        policy and the reference (behavior log-probs where neither a pass nor a forward ran), as
        0-dim tensors (read with the step's statistics)."""
        bt = x.rows.bt
        source = log.filled if (x.weights.proximal is not None or s.train_policy) else bt.behavior_logprobs
        kl = ops.kl_estimate(source, x.passes.ref_lp, self.cfg.kl.kind)             # (B, L-1)
        return ops.masked_mean(kl, bt.mask), ops.masked_sum(kl, bt.mask, dim=-1).mean()

