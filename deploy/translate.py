"""Another trainer's GRPO config as a slipstream config (issue 39): ``slipstream config --from-trl
FILE`` and ``--from-verl FILE``.

TRL: a ``GRPOConfig`` as YAML or JSON (flat, by field name: what ``trl grpo --config`` reads, with
``ModelConfig``'s ``model_name_or_path``, ``use_peft``, ``lora_*`` and the script's
``dataset_name``, ``reward_funcs``), or a ``trl grpo`` command line (``--key value``,
``--key=value``, ``--flag``; ``accelerate launch`` in front of it is skipped, its
``--num_processes`` is the world size). ``trl.experimental.async_grpo``'s ``max_staleness`` and
``weight_sync_steps`` are read too.

verl: a PPO/GRPO YAML of ``ppo_trainer.yaml``'s tree (whole or partial), or a command line of Hydra
overrides (``python3 -m verl.trainer.main_ppo key.path=value ...``; ``+key`` and ``++key`` too);
the fully-async recipe's ``async_training.*`` included.

A key the file leaves out takes *that project's* default (TRL's learning rate is 1e-6, verl's
group size 1), so the result is the run the file describes, spelled for slipstream; every key it
sets is written out. Comment lines say, per setting, where the two differ or that slipstream has
no equivalent. What cannot be translated is never silently dropped: each such key gets its line.
Pure Python over dicts (no torch); the output is checked by loading it with
:func:`deploy.config_file.load_config` in the tests.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

import yaml

from protocol import StartupError
from rollout_server.config import GenerationOptions

SERVER_LIMIT = GenerationOptions.model_fields["max_new_tokens_limit"].default
"""A rollout server's default completion limit: a longer max_new_tokens raises it too."""

__all__ = ["from_trl", "from_verl", "read_trl", "read_verl", "render"]


class Translation:
    """The foreign settings over that project's defaults, the config being built (nested dicts) and
    the comment lines. :meth:`take` reads settings and marks them translated; :attr:`unhandled`
    is what the file set that nothing took."""

    def __init__(self, source: str, settings: dict, defaults: dict):
        self.source = source
        self.settings = {**defaults, **settings}
        self.given = set(settings)
        self.handled: set[str] = set()
        self.cfg: dict = {}
        self.notes: list[str] = []

    def take(self, *keys: str) -> list:
        self.handled.update(keys)
        return [self.settings.get(k) for k in keys]

    @property
    def unhandled(self) -> list[str]:
        return sorted(self.given - self.handled)

    def set(self, key: str, value: Any) -> None:
        node = self.cfg
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.cfg
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def note(self, key: str, value: Any, text: str) -> None:
        self.notes.append(f"{key}={_show(value)}: {text}")


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def render(t: Translation) -> str:
    """The YAML, headed by where it came from and one comment line per difference."""
    head = [f"# Translated from {t.source} by slipstream config. Where the two differ:"]
    head += [f"# - {n}" for n in t.notes] or ["# - nothing: every setting has its equivalent."]
    return "\n".join(head) + "\n" + yaml.safe_dump(t.cfg, sort_keys=False)


def _scalar(text: str) -> Any:
    """A command-line value: a number (1e-6 too, which YAML 1.1 reads as text), else as YAML reads
    it (true, [a, b], null; Hydra's True/False/None), else the text; $VARIABLES expanded."""
    text = os.path.expandvars(text)
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    if text in ("None", "null", "~"):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if value is None else value


def _command_tokens(text: str) -> list[str]:
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as e:
        raise StartupError(f"cannot read the command line: {e}") from None


def _read_mapping(path: Path) -> tuple[dict | None, str]:
    if not path.is_file():
        raise StartupError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StartupError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        data = None
    return (data if isinstance(data, dict) else None), text


# ---- TRL -------------------------------------------------------------------------------------------

TRL_DEFAULTS: dict[str, Any] = {
    "num_generations": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "generation_batch_size": None, "steps_per_generation": None, "num_iterations": 1, "max_steps": -1,
    "num_train_epochs": 3.0, "learning_rate": 1e-6, "lr_scheduler_type": "linear", "warmup_steps": 0,
    "warmup_ratio": 0.0, "max_grad_norm": 1.0, "weight_decay": 0.0, "epsilon": 0.2, "epsilon_high": None,
    "delta": None, "loss_type": "dapo", "importance_sampling_level": "token", "beta": 0.0,
    "use_bias_correction_kl": True, "scale_rewards": "group", "reward_weights": None, "reward_funcs": None,
    "reward_model_name_or_path": None, "max_completion_length": 512, "max_prompt_length": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
    "mask_truncated_completions": False, "entropy_coef": 0.0, "top_entropy_quantile": 1.0,
    "use_vllm": False, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_cap": None, "vllm_importance_sampling_clip_min": None,
    "vllm_gpu_memory_utilization": 0.3, "vllm_tensor_parallel_size": 1, "vllm_max_model_length": None,
    "vllm_mode": "colocate",
    "disable_dropout": False, "gradient_checkpointing": True, "seed": 42, "shuffle_dataset": True,
    "output_dir": None, "save_steps": 500, "save_strategy": "steps", "save_total_limit": None,
    "report_to": "none", "model_name_or_path": None, "use_peft": False, "lora_r": 16, "lora_alpha": 32,
    "lora_dropout": 0.05, "lora_target_modules": None, "dataset_name": None, "dataset_train_split": "train",
    "num_processes": 1, "max_staleness": None, "weight_sync_steps": 1,
}
"""TRL 1.16.0's defaults of the keys translated (GRPOConfig, TrainingArguments, ModelConfig, the
grpo script's arguments; ``num_processes`` is accelerate's world size)."""

TRL_SILENT = {"logging_steps", "logging_first_step", "log_completions", "num_completions_to_print",
              "bf16", "fp16", "tf32", "push_to_hub", "hub_model_id", "run_name", "overwrite_output_dir",
              "dataloader_num_workers", "remove_unused_columns", "logging_dir", "save_only_model"}
"""Keys about logging, precision and the Hub: said in one line together."""

TRL_REWARD_REGISTRY = {"accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                       "get_soft_overlong_punishment"}


def read_trl(path: str | Path) -> tuple[dict, str]:
    """The settings of a TRL config file or ``trl grpo`` command line, by field name."""
    path = Path(path)
    data, text = _read_mapping(path)
    if data is not None:
        if not any(k in TRL_DEFAULTS or k in TRL_SILENT for k in data):
            raise StartupError(f"{path}: not a TRL GRPO config (none of its keys is a GRPOConfig field, "
                               "e.g. learning_rate, num_generations)")
        return dict(data), f"TRL config {path.name}"
    tokens = _command_tokens(text)
    if "grpo" not in tokens:
        raise StartupError(f"{path}: neither a TRL GRPO config (YAML/JSON) nor a `trl grpo` command line")
    out: dict[str, Any] = {}
    start = tokens.index("grpo")
    for i, tok in enumerate(tokens[:start]):        # accelerate launch --num_processes N trl grpo ...
        if tok.startswith("--num_processes"):
            out["num_processes"] = int(tok.split("=", 1)[1] if "=" in tok else tokens[i + 1])
    args = tokens[start + 1:]
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            i += 1
            continue
        key, eq, value = tok[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            out[key] = _scalar(value)
            i += 1
            continue
        values = []
        while i + 1 < len(args) and not args[i + 1].startswith("--"):
            values.append(_scalar(args[i + 1]))
            i += 1
        i += 1
        if key.startswith("no_") and not values:
            out[key[3:]] = False
        elif key == "config" and values:            # trl grpo --config f.yaml: its values under the flags
            base, _ = read_trl(path.parent / str(values[0]))
            out = {**base, **out}
        else:
            out[key] = True if not values else values[0] if len(values) == 1 and key not in (
                "reward_funcs", "lora_target_modules", "report_to", "reward_weights") else values
    return out, f"`trl grpo` command line {path.name}"


def from_trl(settings: dict, source: str = "a TRL config") -> Translation:
    """The slipstream config of a TRL GRPO run (see the module docstring)."""
    t = Translation(source, settings, TRL_DEFAULTS)
    s, given, take = t.settings, t.given, t.take

    # -- batch shape ------------------------------------------------------------------------
    w, p, ga, g = take("num_processes", "per_device_train_batch_size", "gradient_accumulation_steps",
                       "num_generations")
    gen_bs, spg, mu = take("generation_batch_size", "steps_per_generation", "num_iterations")
    b = gen_bs or p * w * (spg or ga)
    if b % g:
        t.note("generation_batch_size", b, f"not a multiple of num_generations {g}; batch_prompts rounds down")
    t.set("learner.batch.batch_prompts", max(1, b // g))
    t.set("learner.batch.group_size", g)
    t.set("learner.batch.micro_batch_samples", p)
    t.set("learner.batch.mini_batch_samples", 0 if p * ga * w == b else p * ga * w)
    t.set("learner.batch.ppo_epochs", mu)
    if "num_processes" not in given:
        t.note("world size", w, "TRL's batch counts completions on every process (accelerate's "
               "num_processes, not in this file): give --world-size N if it was not 1")
    k = mu * (b / (p * w)) / ga          # optimizer steps per slipstream policy step
    if k != 1:
        t.note("optimizer steps per batch", k, "TRL's step counts (max_steps, warmup, save_steps) are "
               f"optimizer steps; slipstream's are policy steps (one batch): divided by {k:g}")

    # -- length of the run ------------------------------------------------------------------
    max_steps, epochs = take("max_steps", "num_train_epochs")
    total = None
    if max_steps and max_steps > 0:
        total = math.ceil(max_steps / k)
        t.set("learner.total_steps", total)
    else:
        t.set("learner.data.epochs", math.ceil(epochs))
        t.set("learner.total_steps", 1_000_000)
        t.note("num_train_epochs", epochs, f"slipstream counts whole epochs ({math.ceil(epochs)}) and ends "
               "after the last full batch of the last one (learner.total_steps is only a bound here)")

    # -- optimizer ----------------------------------------------------------------------------
    lr, sched, warm, ratio, clip, wd = take("learning_rate", "lr_scheduler_type", "warmup_steps",
                                            "warmup_ratio", "max_grad_norm", "weight_decay")
    t.set("learner.optimizer.lr", lr)
    schedules = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                 "constant_with_warmup": "constant"}
    if sched in schedules:
        t.set("learner.optimizer.lr_schedule", schedules[sched])
    else:
        t.set("learner.optimizer.lr_schedule", "constant")
        t.note("lr_scheduler_type", sched, "no equivalent (slipstream: constant, linear or cosine); constant")
    if isinstance(warm, float) and 0 < warm < 1:
        ratio, warm = warm, 0
    if warm:
        t.set("learner.optimizer.lr_warmup_steps", max(1, round(warm / k)))
    elif ratio:
        if total is None:
            t.note("warmup_ratio", ratio, "a fraction of a run whose length is set in epochs: give "
                   "learner.optimizer.lr_warmup_steps by hand")
        else:
            t.set("learner.optimizer.lr_warmup_steps", math.ceil(ratio * total))
    t.set("learner.optimizer.max_grad_norm", clip)
    t.set("learner.optimizer.weight_decay", wd)

    # -- policy loss ----------------------------------------------------------------------------
    eps, eps_high, delta, loss_type, level = take("epsilon", "epsilon_high", "delta", "loss_type",
                                                  "importance_sampling_level")
    high = eps if eps_high is None else eps_high
    aggregation = {"dapo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
                   "bnpo": "token_mean", "cispo": "token_mean"}
    t.set("learner.algorithm.loss_agg", aggregation.get(loss_type, "token_mean"))
    if loss_type == "bnpo":
        t.note("loss_type", loss_type, "TRL normalizes by the tokens of each local micro-batch; "
               "slipstream's token_mean by the batch's (the same when one micro-batch is the batch)")
    elif loss_type not in aggregation:
        t.note("loss_type", loss_type, "no equivalent (slipstream: dapo, grpo, dr_grpo, bnpo, cispo); token_mean")
    if loss_type == "cispo":
        t.set("learner.algorithm.policy_loss", "cispo")
        if eps_high is None or eps_high <= 1:
            t.note("epsilon_high", eps_high, "TRL's cispo caps the ratio at epsilon_high itself; a cap "
                   "<= 1 has no slipstream equivalent: clip_high 4.0 (ScaleRL's cap 5)")
            high = 4.0
        else:
            high = eps_high - 1
        eps = 0.99
        t.note("epsilon", s["epsilon"], "cispo: TRL has no lower bound on the ratio; clip_low 0.99")
    elif level == "sequence":
        t.set("learner.algorithm.policy_loss", "gspo")
    else:
        t.set("learner.algorithm.policy_loss", "ppo")
    if level not in ("token", "sequence"):
        t.note("importance_sampling_level", level, "no equivalent (token or sequence)")
    t.set("learner.algorithm.clip_low", eps)
    t.set("learner.algorithm.clip_high", high)
    if delta is not None:
        t.set("learner.algorithm.dual_clip", delta)
        if delta < 1 + high:
            t.note("delta", delta, f"slipstream's dual clip binds only for negative advantages; TRL's delta "
                   f"below 1 + epsilon_high ({1 + high:g}) also caps positive ones")

    # -- advantages and KL ------------------------------------------------------------------------
    scale, beta, bias = take("scale_rewards", "beta", "use_bias_correction_kl")
    scale = {True: "group", False: "none"}.get(scale, scale)
    t.set("learner.algorithm.advantage", {"group": "grpo", "none": "dr_grpo", "batch": "dr_grpo"}.get(scale, "grpo"))
    if scale == "batch":
        t.set("learner.reward.norm", "batch")
    elif scale not in ("group", "none"):
        t.note("scale_rewards", scale, "no equivalent (group, batch, none); grpo")
    t.set("learner.kl.coef", beta)
    if beta:
        t.set("learner.kl.kind", "k3")
        t.set("learner.kl.in_reward", False)
        if bias:
            t.note("use_bias_correction_kl", bias, "TRL weighs its k3 term by the policy ratio; slipstream's "
                   "k3 loss term is not weighed")

    # -- rewards ------------------------------------------------------------------------------------
    funcs, weights, rm = take("reward_funcs", "reward_weights", "reward_model_name_or_path")
    specs, names = [], []
    for f in ([funcs] if isinstance(funcs, str) else funcs or []):
        if f == "get_soft_overlong_punishment":
            t.set("learner.reward.overlong_buffer_tokens", 256)
            t.set("learner.reward.overlong_penalty", 1.0)
            t.note("reward_funcs", f, "TRL's registry entry (max 1280, cache 256) as slipstream's DAPO "
                   "overlong penalty over the last 256 of max_new_tokens, applied before advantages")
            continue
        if f in TRL_REWARD_REGISTRY:
            specs.append(f"trl:trl.rewards:{f}")
        elif "." in f:
            module, _, fn = f.rpartition(".")
            specs.append(f"trl:{module}:{fn}")
        else:
            t.note("reward_funcs", f, "not in TRL's registry and not a dotted module.function; left out")
            continue
        names.append(specs[-1].rpartition(":")[2])
    if rm:
        specs.insert(0, "builtin:reward_model")
        names.insert(0, "reward_model")
        t.set("rollout.reward.options.reward_model", rm)
    if specs:
        t.set("rollout.reward.fn", specs)
    else:
        t.note("reward_funcs", funcs, "no reward function named (TRL's script passes them in Python): set "
               "rollout.reward.fn, e.g. trl:my_module:my_reward")
    if weights:
        if len(weights) != len(names):
            t.note("reward_weights", weights, f"{len(weights)} weights for {len(names)} functions; left out")
        else:
            t.set("rollout.reward.weights", dict(zip(names, weights)))

    # -- sampling -----------------------------------------------------------------------------------
    n_new, n_prompt, temp, top_p, top_k, min_p, rep = take(
        "max_completion_length", "max_prompt_length", "temperature", "top_p", "top_k", "min_p",
        "repetition_penalty")
    t.set("learner.sampling.max_new_tokens", n_new)
    if n_new > SERVER_LIMIT:
        t.set("rollout.generation.max_new_tokens_limit", n_new)
    if n_prompt:
        t.set("learner.data.max_prompt_tokens", n_prompt)
        t.note("max_prompt_length", n_prompt, "TRL truncates longer prompts on the left; slipstream skips "
               "them (counted in slipstream_prompts_skipped_total)")
    t.set("learner.sampling.temperature", temp)
    for key, value, off in (("top_p", top_p, 1.0), ("top_k", top_k, 0), ("min_p", min_p, None),
                            ("repetition_penalty", rep, 1.0)):
        if value not in (off, None) and not (key == "top_k" and value in (0, -1)):
            t.note(key, value, "no equivalent: slipstream samples the full distribution (the importance "
                   "weights assume it); left out")
    masked, ent, quantile = take("mask_truncated_completions", "entropy_coef", "top_entropy_quantile")
    t.set("learner.reward.mask_truncated", bool(masked))
    t.set("learner.algorithm.entropy_coef", ent)
    if quantile != 1.0:
        t.note("top_entropy_quantile", quantile, "no equivalent (every token trains)")

    # -- engine and importance correction ---------------------------------------------------------------
    use_vllm, corr, mode, cmax, cap, cmin = take(
        "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min")
    cmax = cap if cap is not None else cmax
    t.set("rollout.engine", "vllm" if use_vllm else "hf")
    if use_vllm:
        mem, tp, mml = take("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length")
        t.set("rollout.vllm.gpu_memory_utilization", mem)
        t.set("rollout.vllm.tensor_parallel_size", tp)
        if mml:
            t.set("rollout.vllm.max_model_len", mml)
    if use_vllm and corr:
        modes = {"token_truncate": "tis", "token_mask": "icepop", "sequence_truncate": "seq_tis",
                 "sequence_mask": "seq_mis"}
        t.set("learner.algorithm.is_mode", modes.get(mode, "tis"))
        if mode == "token_mask":
            t.set("learner.algorithm.icepop_high", max(1.0, cmax))
            t.set("learner.algorithm.icepop_low", cmin if cmin else 1e-6)
        else:
            t.set("learner.algorithm.is_cap", max(cmax, 1.0001))
        if mode and mode.startswith("sequence"):
            t.note("vllm_importance_sampling_mode", mode, "TRL's sequence weight is the product of the "
                   "token ratios, slipstream's the geometric mean: the caps are not comparable")
        if mode not in modes:
            t.note("vllm_importance_sampling_mode", mode, "no equivalent; tis")
    else:
        t.note("vllm_importance_sampling_correction", bool(use_vllm and corr),
               "TRL corrects nothing here; slipstream keeps its default (tis, cap 5), which also corrects "
               "staleness (learner.algorithm.is_mode: none to match)")
    take("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length")
    vllm_mode, = take("vllm_mode")
    if vllm_mode is not None and "vllm_mode" in given:
        t.note("vllm_mode", vllm_mode, "slipstream's rollout servers are processes of their own, beside the "
               "learner or on other hosts (slipstream run, or slipstream rollout --learner)")

    # -- staleness ------------------------------------------------------------------------------------
    async_eta, sync_steps = take("max_staleness", "weight_sync_steps")
    if async_eta is not None:       # trl.experimental.async_grpo
        t.set("learner.staleness.max_staleness", int(async_eta) * int(sync_steps))
        t.set("learner.staleness.stale_policy", "drop")
        t.note("max_staleness", async_eta, "TRL's async GRPO counts weight syncs "
               f"(x weight_sync_steps {sync_steps}), slipstream policy steps; TRL trains on the vLLM "
               "log-probs without correction (slipstream recomputes them and corrects with is_mode)")
    else:
        t.set("learner.staleness.max_staleness", 0)
        t.note("staleness", 0, "TRL's GRPOTrainer is synchronous: max_staleness 0 is the same run; 1 or "
               "more overlaps generation with training (slipstream's point), corrected by is_mode")

    # -- runtime, checkpoints, logging ----------------------------------------------------------------
    dropout, ckpt, seed, shuffle = take("disable_dropout", "gradient_checkpointing", "seed", "shuffle_dataset")
    t.set("learner.runtime.disable_dropout", bool(dropout))
    t.set("learner.runtime.gradient_checkpointing", bool(ckpt))
    t.set("learner.seed", seed)
    t.set("rollout.seed", seed)
    t.set("learner.data.shuffle", bool(shuffle))
    out_dir, save_steps, save_strategy, limit, report = take("output_dir", "save_steps", "save_strategy",
                                                              "save_total_limit", "report_to")
    if out_dir:
        t.set("learner.run_dir", out_dir)
    if save_strategy == "no":
        t.set("learner.checkpoint.save_every", 0)
    elif save_strategy == "steps" and save_steps:
        every = save_steps if save_steps >= 1 else save_steps * (total or 0)
        t.set("learner.checkpoint.save_every", max(1, round(every / k)) if every else 0)
    else:
        t.note("save_strategy", save_strategy, "no equivalent (slipstream saves every N steps)")
    if limit:
        t.set("learner.checkpoint.keep_last", limit)
    sinks = ["jsonl"] + [r for r in ([report] if isinstance(report, str) else report or [])
                         if r in ("tensorboard", "wandb")]
    t.set("learner.metrics_sinks", sinks)

    # -- model, LoRA, data --------------------------------------------------------------------------
    model, peft, r, alpha, ldrop, targets = take("model_name_or_path", "use_peft", "lora_r", "lora_alpha",
                                                 "lora_dropout", "lora_target_modules")
    if model:
        t.set("model", model)
    if peft:
        t.set("learner.lora", {"r": r, "alpha": alpha, "dropout": ldrop,
                               "target_modules": targets or ["q_proj", "v_proj"]})
        if not targets:
            t.note("lora_target_modules", None, "PEFT's default for Llama/Qwen ([q_proj, v_proj]) written "
                   "out; slipstream's own default is all-linear")
        if use_vllm:
            t.set("rollout.vllm.enable_lora", True)
            t.set("rollout.vllm.max_lora_rank", r)
    dataset, split = take("dataset_name", "dataset_train_split")
    t.set("learner.data.preset", "trl")
    t.set("learner.data.answer_key", None)
    if dataset:
        t.set("learner.data.dataset", dataset)
        t.note("dataset_name", dataset, "slipstream reads a local file or save_to_disk directory, never the "
               "Hub: save the dataset first (datasets.load_dataset(...).save_to_disk(DIR))")
    t.set("learner.data.dataset_split", split)

    silent = sorted(k for k in given if k in TRL_SILENT)
    if silent:
        t.note(", ".join(silent), "...", "logging cadence, precision and Hub settings: slipstream logs every "
               "step, picks its precision with learner.runtime.autocast (auto), and pushes nothing")
    for key in (k for k in t.unhandled if k not in TRL_SILENT):
        t.note(key, settings[key], "no slipstream equivalent; not translated")
    return t


# ---- verl --------------------------------------------------------------------------------------------

VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024, "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.ppo_epochs": 1, "trainer.total_training_steps": None, "trainer.total_epochs": 30,
    "actor_rollout_ref.actor.optim.lr": 1e-6, "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.warmup_style": None, "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0, "actor_rollout_ref.actor.optim.min_lr_ratio": 0.0,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01, "actor_rollout_ref.actor.optim.clip_grad": 1.0,
    "actor_rollout_ref.actor.grad_clip": None, "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0, "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "actor_rollout_ref.actor.loss_scale_factor": None,
    "actor_rollout_ref.actor.entropy_coeff": 0.0, "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001, "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.target_kl": 0.1, "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.adv_estimator": "gae", "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0, "algorithm.filter_groups.enable": False,
    "algorithm.rollout_correction.rollout_is": None, "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.bypass_mode": False,
    "data.max_prompt_length": 512, "data.max_response_length": 512,
    "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1, "actor_rollout_ref.rollout.name": "vllm",
    "data.train_files": None, "data.val_files": None, "data.prompt_key": "prompt", "data.shuffle": True,
    "data.seed": None, "trainer.test_freq": -1, "custom_reward_function.path": None,
    "custom_reward_function.name": "compute_score", "reward.custom_reward_function.path": None,
    "reward.custom_reward_function.name": "compute_score", "actor_rollout_ref.model.path": None,
    "actor_rollout_ref.model.lora_rank": 0, "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.model.target_modules": "all-linear",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True, "trainer.save_freq": -1,
    "trainer.default_local_dir": None, "trainer.max_actor_ckpt_to_keep": None, "trainer.logger": ["console"],
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "actor_rollout_ref.rollout.enforce_eager": False,
    "async_training.staleness_threshold": None, "async_training.trigger_parameter_sync_step": 1,
    "async_training.require_batches": 1, "async_training.partial_rollout": None,
}
"""verl 0.9.1's defaults (``_generated_ppo_trainer.yaml``) of the keys translated."""

VERL_INFRASTRUCTURE = ("fsdp_config", "profiler", "megatron", "ray_kwargs", "global_profiler", "nccl",
                       "checkpoint", "transfer_queue", "engine", "npu_profile", "checkpoint_engine",
                       "agent", "multi_turn", "trace", "_target_", "defaults")
"""Key parts of cluster and engine plumbing: said once per prefix (slipstream: deploy/, DeepSpeed)."""


VERL_OTHER = {
    "trainer.n_gpus_per_node": "GPUs: the learner's `slipstream learner --nproc N` (DeepSpeed) and the rollout "
                               "servers (launcher.num_rollout_servers, or slipstream rollout on other hosts)",
    "trainer.nnodes": "hosts: rollout servers join from any host (slipstream rollout --learner tcp://HOST:PORT)",
    "trainer.project_name": "W&B names: the wandb sink takes them from WANDB_PROJECT / WANDB_NAME",
    "trainer.experiment_name": "W&B names: the wandb sink takes them from WANDB_PROJECT / WANDB_NAME",
    "data.filter_overlong_prompts": "slipstream always skips (and counts) prompts over learner.data.max_prompt_tokens",
    "data.truncation": "slipstream never truncates a prompt: longer ones are skipped and counted",
}
"""Why some common verl keys have no slipstream key of their own."""


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def read_verl(path: str | Path) -> tuple[dict, str]:
    """The settings of a verl YAML or Hydra command line, by dotted key."""
    path = Path(path)
    data, text = _read_mapping(path)
    if data is not None:
        flat = _flatten(data)
        if not any(k.split(".")[0] in ("data", "actor_rollout_ref", "algorithm", "trainer", "async_training")
                   for k in flat):
            raise StartupError(f"{path}: not a verl config (no data, actor_rollout_ref, algorithm or trainer keys)")
        return flat, f"verl config {path.name}"
    out = {}
    for tok in _command_tokens(text):
        key, eq, value = tok.lstrip("+").partition("=")
        if eq and "." in key and not key.startswith("-"):
            out[key] = _scalar(value)
    if not out:
        raise StartupError(f"{path}: neither a verl YAML nor a command line of key.path=value overrides")
    return out, f"verl command line {path.name}"


def from_verl(settings: dict, source: str = "a verl config") -> Translation:
    """The slipstream config of a verl PPO/GRPO run (see the module docstring)."""
    t = Translation(source, settings, VERL_DEFAULTS)
    given, take = t.given, t.take
    A, R, M, RC = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model.",
                   "algorithm.rollout_correction.")

    # -- batch shape ----------------------------------------------------------------------------------
    prompts, n, mini, micro, dyn, max_tok, epochs = take(
        "data.train_batch_size", R + "n", A + "ppo_mini_batch_size", A + "ppo_micro_batch_size_per_gpu",
        A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu", A + "ppo_epochs")
    s_thr, sync_steps, req = take("async_training.staleness_threshold",
                                  "async_training.trigger_parameter_sync_step", "async_training.require_batches")
    fully_async = s_thr is not None or any(k.startswith("async_training.") for k in given)
    if fully_async:          # one slipstream policy step = one verl version (a parameter sync)
        prompts = mini * req * sync_steps
        t.note("async_training", "...", f"fully async: one slipstream step is one verl parameter sync "
               f"({sync_steps} optimizer steps of {mini * req} prompts)")
    t.set("learner.batch.batch_prompts", prompts)
    t.set("learner.batch.group_size", n)
    if n == 1:
        t.note(R + "n", n, "verl's default of one response per prompt: group advantages (grpo, rloo) need 2 or more")
    per_update = mini * (req if fully_async else 1)          # prompts per optimizer step
    t.set("learner.batch.mini_batch_samples", 0 if per_update == prompts else per_update * n)
    if micro:
        t.set("learner.batch.micro_batch_samples", micro)
    if dyn:
        t.set("learner.batch.micro_batch_tokens", max_tok)
        t.note(A + "ppo_max_token_len_per_gpu", max_tok, "verl packs tokens; slipstream counts a "
               "micro-batch as its samples x the longest (padded)")
    t.set("learner.batch.ppo_epochs", epochs)

    steps, total_epochs = take("trainer.total_training_steps", "trainer.total_epochs")
    if steps:
        t.set("learner.total_steps", steps)
    else:
        t.set("learner.data.epochs", total_epochs)
        t.set("learner.total_steps", 1_000_000)
        t.note("trainer.total_epochs", total_epochs, "the run ends after the last full batch of the last "
               "epoch (learner.total_steps is only a bound here)")

    # -- optimizer -------------------------------------------------------------------------------------
    lr, sched, style, warm, ratio, min_ratio, wd, clip, legacy_clip = take(
        A + "optim.lr", A + "optim.lr_scheduler_type", A + "optim.warmup_style", A + "optim.lr_warmup_steps",
        A + "optim.lr_warmup_steps_ratio", A + "optim.min_lr_ratio", A + "optim.weight_decay",
        A + "optim.clip_grad", A + "grad_clip")
    t.set("learner.optimizer.lr", lr)
    sched = style or sched
    t.set("learner.optimizer.lr_schedule", sched if sched in ("constant", "cosine") else "constant")
    if sched not in ("constant", "cosine"):
        t.note(A + "optim.lr_scheduler_type", sched, "no equivalent; constant")
    if warm and warm > 0:
        t.set("learner.optimizer.lr_warmup_steps", warm)
    elif ratio:
        if steps:
            t.set("learner.optimizer.lr_warmup_steps", int(ratio * steps))
        else:
            t.note(A + "optim.lr_warmup_steps_ratio", ratio, "a fraction of a run set in epochs: give "
                   "learner.optimizer.lr_warmup_steps by hand")
    t.set("learner.optimizer.min_lr_ratio", min_ratio)
    t.set("learner.optimizer.weight_decay", wd)
    t.set("learner.optimizer.max_grad_norm", legacy_clip if legacy_clip is not None else clip)

    # -- policy loss ----------------------------------------------------------------------------------
    cr, low, high, c, mode, agg, scale_factor, ent = take(
        A + "clip_ratio", A + "clip_ratio_low", A + "clip_ratio_high", A + "clip_ratio_c",
        A + "policy_loss.loss_mode", A + "loss_agg_mode", A + "loss_scale_factor", A + "entropy_coeff")
    t.set("learner.algorithm.clip_low", cr if low is None else low)
    t.set("learner.algorithm.clip_high", cr if high is None else high)
    if A + "clip_ratio" in given and (A + "clip_ratio_low" not in given or A + "clip_ratio_high" not in given):
        t.note(A + "clip_ratio", cr, "verl uses it only where clip_ratio_low/high are null (their defaults "
               "are 0.2), so it changed nothing there; the same here")
    losses = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}
    t.set("learner.algorithm.policy_loss", losses.get(mode, "ppo"))
    if mode not in losses:
        t.note(A + "policy_loss.loss_mode", mode, "no equivalent (vanilla, gspo, cispo); ppo")
    if losses.get(mode, "ppo") == "ppo":
        t.set("learner.algorithm.dual_clip", c)            # verl's vanilla loss always dual-clips
    aggs = {"token-mean": "token_mean", "seq-mean-token-sum": "seq_mean_token_sum",
            "seq-mean-token-mean": "seq_mean_token_mean", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}
    t.set("learner.algorithm.loss_agg", aggs.get(agg, "token_mean"))
    if agg not in aggs:
        t.note(A + "loss_agg_mode", agg, "no equivalent; token_mean")
    if scale_factor:
        t.set("learner.algorithm.loss_norm_tokens", scale_factor)
    t.set("learner.algorithm.entropy_coef", ent)

    # -- advantages and KL --------------------------------------------------------------------------
    est, norm, gamma, lam = take("algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
                                 "algorithm.gamma", "algorithm.lam")
    estimators = {"gae": "gae", "grpo": "grpo", "grpo_vectorized": "grpo", "rloo": "rloo",
                  "rloo_vectorized": "rloo", "reinforce_plus_plus": "reinforce_pp"}
    adv = estimators.get(est, "grpo")
    if adv == "grpo" and not norm:
        adv = "dr_grpo"
    t.set("learner.algorithm.advantage", adv)
    if est not in estimators:
        t.note("algorithm.adv_estimator", est, "no equivalent (gae, grpo, rloo, reinforce_plus_plus); grpo")
    t.set("learner.algorithm.gamma", gamma)
    t.set("learner.algorithm.lam", lam)
    kinds = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
    use_loss, loss_coef, loss_type, in_reward, penalty = take(
        A + "use_kl_loss", A + "kl_loss_coef", A + "kl_loss_type", "algorithm.use_kl_in_reward", "algorithm.kl_penalty")
    ctl, ctl_coef, target, horizon = take("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
                                          "algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon")
    if use_loss and in_reward:
        t.note("algorithm.use_kl_in_reward", True, "verl has a KL loss and a KL reward; slipstream has one "
               "KL term: the loss is kept")
    if use_loss:
        t.set("learner.kl.coef", loss_coef)
        t.set("learner.kl.in_reward", False)
        t.set("learner.kl.kind", kinds.get(loss_type, "k3"))
        if loss_type not in kinds:
            t.note(A + "kl_loss_type", loss_type, "no equivalent (kl, mse, low_var_kl); k3")
    elif in_reward:
        t.set("learner.kl.coef", ctl_coef)
        t.set("learner.kl.in_reward", True)
        t.set("learner.kl.kind", kinds.get(penalty, "k1"))
        t.set("learner.kl.controller", "adaptive" if ctl == "adaptive" else "fixed")
        if ctl == "adaptive":
            t.set("learner.kl.target", target)
            t.set("learner.kl.horizon", horizon)
            t.note("algorithm.kl_ctrl.target_kl", target, "verl's target is a per-token mean KL, "
                   "slipstream's a per-sample sum: multiply by the mean completion length")
    else:
        t.set("learner.kl.coef", 0.0)

    # -- importance correction and staleness -----------------------------------------------------------
    is_level, thr, bypass = take(RC + "rollout_is", RC + "rollout_is_threshold", RC + "bypass_mode")
    if bypass:
        t.set("learner.algorithm.recompute_logprobs", False)
    if is_level is None:
        t.note(RC + "rollout_is", None, "verl corrects nothing here; slipstream keeps its default (tis, cap 5), "
               "which also corrects staleness (learner.algorithm.is_mode: none to match)")
    elif isinstance(thr, str) and "_" in thr and is_level == "token":
        lo, hi = (float(x) for x in thr.split("_", 1))
        t.set("learner.algorithm.is_mode", "icepop")
        t.set("learner.algorithm.icepop_low", lo)
        t.set("learner.algorithm.icepop_high", hi)
    elif is_level == "token":
        t.set("learner.algorithm.is_mode", "tis")
        t.set("learner.algorithm.is_cap", float(thr))
    else:
        t.set("learner.algorithm.is_mode", "seq_tis")
        t.set("learner.algorithm.is_cap", float(thr) if not isinstance(thr, str) else 5.0)
        t.note(RC + "rollout_is", is_level, "verl's sequence weight is the product of the token ratios, "
               "slipstream's the geometric mean: the caps are not comparable")
    if fully_async:
        eta = math.ceil(s_thr or 0)
        t.set("learner.staleness.max_staleness", eta)
        t.note("async_training.staleness_threshold", s_thr, f"verl bounds the prompts in flight to "
               f"(1 + s) x a sync's worth (about ceil(s) = {eta} versions of lag, nothing dropped for age); "
               "slipstream's max_staleness bounds every sample's lag in steps")
        partial, = take("async_training.partial_rollout")
        if partial:
            t.set("rollout.generation.inflight_update", "continue")
    else:
        t.set("learner.staleness.max_staleness", 0)
        t.note("staleness", 0, "verl's PPO trainer is synchronous: max_staleness 0 is the same run; 1 or "
               "more overlaps generation with training (slipstream's point), corrected by is_mode")

    # -- sampling and lengths ---------------------------------------------------------------------------
    n_prompt, n_new, temp, top_p, top_k, engine = take(
        "data.max_prompt_length", "data.max_response_length", R + "temperature", R + "top_p", R + "top_k", R + "name")
    t.set("learner.data.max_prompt_tokens", n_prompt)
    t.set("learner.sampling.max_new_tokens", n_new)
    if n_new > SERVER_LIMIT:
        t.set("rollout.generation.max_new_tokens_limit", n_new)
    t.set("learner.sampling.temperature", temp)
    if top_p not in (1, 1.0, None):
        t.note(R + "top_p", top_p, "no equivalent: slipstream samples the full distribution; left out")
    if top_k not in (-1, 0, None):
        t.note(R + "top_k", top_k, "no equivalent: slipstream samples the full distribution; left out")
    t.set("rollout.engine", "vllm" if engine in ("vllm", None) else "hf")
    if engine not in ("vllm", "hf", None):
        t.note(R + "name", engine, "no equivalent engine (vllm, or hf: transformers); hf")
    mem, tp, eager = take(R + "gpu_memory_utilization", R + "tensor_model_parallel_size", R + "enforce_eager")
    t.set("rollout.vllm.gpu_memory_utilization", mem)
    t.set("rollout.vllm.tensor_parallel_size", tp)
    t.set("rollout.vllm.enforce_eager", bool(eager))

    # -- data, reward, model --------------------------------------------------------------------------------
    train, val, pkey, shuffle, dseed, test_freq = take("data.train_files", "data.val_files", "data.prompt_key",
                                                       "data.shuffle", "data.seed", "trainer.test_freq")
    t.set("learner.data.preset", "verl")
    if isinstance(train, list):
        if len(train) == 1:
            train = train[0]
        else:
            t.set("learner.data.datasets", [{"path": f, "weight": 1.0} for f in train])
            t.note("data.train_files", train, "several files: a mixture, each weighted by 1 (verl "
                   "concatenates them: weight them by their row counts to match)")
            train = None
    if train:
        t.set("learner.data.dataset", train)
    t.set("learner.data.prompt_key", pkey)
    t.set("learner.data.shuffle", bool(shuffle))
    if dseed is not None:
        t.set("learner.seed", dseed)
    if val and test_freq and test_freq > 0:
        t.set("learner.evaluation.data", val[0] if isinstance(val, list) else val)
        t.set("learner.evaluation.every", test_freq)
    path, name, path2, name2 = take("custom_reward_function.path", "custom_reward_function.name",
                                    "reward.custom_reward_function.path", "reward.custom_reward_function.name")
    if path2 or path:
        t.set("rollout.reward.fn", [f"verl:{path2 or path}:{(name2 if path2 else name) or 'compute_score'}"])
    else:
        t.set("rollout.reward.fn", ["verl:verl.utils.reward_score:default_compute_score"])
        t.note("custom_reward_function.path", None, "verl's own default_compute_score (by data_source): "
               "needs verl importable on the rollout servers")
    model, rank, alpha, targets, gc = take(M + "path", M + "lora_rank", M + "lora_alpha", M + "target_modules",
                                           M + "enable_gradient_checkpointing")
    if model:
        t.set("model", model)
    if rank:
        t.set("learner.lora", {"r": rank, "alpha": alpha, "dropout": 0.0, "target_modules": targets})
        t.set("rollout.vllm.enable_lora", True)
        t.set("rollout.vllm.max_lora_rank", rank)
    t.set("learner.runtime.gradient_checkpointing", bool(gc))
    save, out_dir, keep, logger = take("trainer.save_freq", "trainer.default_local_dir",
                                       "trainer.max_actor_ckpt_to_keep", "trainer.logger")
    t.set("learner.checkpoint.save_every", save if save and save > 0 else 0)
    if out_dir:
        t.set("learner.checkpoint.dir", out_dir)
    if keep:
        t.set("learner.checkpoint.keep_last", keep)
    t.set("learner.metrics_sinks", ["jsonl"] + [x for x in ([logger] if isinstance(logger, str) else logger or [])
                                                if x in ("tensorboard", "wandb")])

    infrastructure: dict[str, int] = {}
    for key in t.unhandled:
        parts = key.split(".")
        hit = next((i for i, p in enumerate(parts) if p in VERL_INFRASTRUCTURE), None)
        if hit is not None:
            prefix = ".".join(parts[:hit + 1])
            infrastructure[prefix] = infrastructure.get(prefix, 0) + 1
            continue
        t.note(key, settings[key], VERL_OTHER.get(key, "no slipstream equivalent; not translated"))
    for prefix, count in sorted(infrastructure.items()):
        t.note(f"{prefix}.*", f"{count} keys", "cluster and engine plumbing: slipstream's processes, "
               "DeepSpeed (learner.deepspeed.*) and deploy/ take their place")
    return t
