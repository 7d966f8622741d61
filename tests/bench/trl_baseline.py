"""The synchronous baseline of bench_async.py: TRL's ``GRPOTrainer`` on the same model and task.

Run by bench_async.py with the interpreter of a separate environment that has ``trl`` (never a
slipstream dependency)::

    /tmp/trl-venv/bin/python tests/bench/trl_baseline.py SPEC.json OUT.json

SPEC (written by bench_async.py): the model directory, the prompts with their answers (drawn from
the same built-in task and seed as slipstream's run), the reward kind (``exact_numeric``: the first
number of the completion equals the answer; ``exact_match``: the stripped completion equals it),
the batch (prompts × group), ``max_completion_length``, temperature, learning rate, steps, seed,
torch threads, ``bf16`` (TRL's own mixed precision, ``GRPOConfig(bf16=...)``; off unless asked)
and ``device`` (cpu, cuda, or auto: CUDA when there is one, where slipstream's processes go too).
This file imports nothing of slipstream, so it runs in TRL's environment alone.

OUT: per optimizer step its end time, the seconds spent generating and scoring (TRL's
``_generate_and_score_completions``, timed by wrapping it) and the mean reward.
"""

from __future__ import annotations

import json
import re
import sys
import time

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def make_reward(kind: str):
    def first_number(text: str) -> str | None:
        m = NUMBER.search(text.replace(",", ""))
        return m.group(0) if m else None

    def reward(prompts, completions, answer, **_):
        out = []
        for c, a in zip(completions, answer, strict=True):
            if kind == "exact_match":
                out.append(1.0 if c.strip() == a.strip() else 0.0)
            else:
                got = first_number(c)
                out.append(1.0 if got is not None and float(got) == float(a) else 0.0)
        return out

    reward.__name__ = kind
    return reward


def make_trainer(spec: dict, reward=None, max_grad_norm: float = 1.0):
    """TRL's GRPOTrainer as the benchmark configures it (``reward``: the reward function, by
    default ``spec["reward"]``'s)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    attn = spec.get("attn_implementation", "auto")
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, **({} if attn == "auto" else {"attn_implementation": attn}))
    # The learner encodes BOS + the prompt's characters; the tokenizer adds no BOS itself here.
    rows = [{"prompt": tok.bos_token + r["prompt"], "answer": r["answer"]} for r in spec["prompts"]]
    batch = spec["batch_prompts"] * spec["group_size"]
    device = spec.get("device", "cpu")          # auto: CUDA when there is one, as slipstream's
    use_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    args = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=use_cpu, bf16=bool(spec.get("bf16", False)),
        gradient_checkpointing=False,
        per_device_train_batch_size=batch, num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=max_grad_norm, beta=0.0, max_steps=spec["steps"], num_iterations=1,
        logging_steps=1, save_strategy="no", report_to="none", seed=spec["seed"],
        shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward or make_reward(spec["reward"]),
                          args=args, train_dataset=Dataset.from_list(rows))
    return trainer


def train(spec: dict, out_path: str) -> None:
    from transformers import TrainerCallback

    trainer = make_trainer(spec)
    steps: list[dict] = []
    gen_s = [0.0]
    inner = trainer._generate_and_score_completions

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            gen_s[0] += time.perf_counter() - t0

    trainer._generate_and_score_completions = timed

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, gen_s[0] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            steps.append({"step": state.global_step, "time": time.time(),
                          "step_s": time.perf_counter() - self.t0, "gen_s": gen_s[0]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and steps and "reward" in logs:
                steps[-1]["reward_mean"] = float(logs["reward"])
                steps[-1]["completion_tokens_mean"] = float(logs.get("completions/mean_length", 0.0))

    trainer.add_callback(Record())
    t0 = time.time()
    trainer.train()
    json.dump({"steps": steps, "wall_s": time.time() - t0, "threads": spec["threads"],
               "bf16": bool(spec.get("bf16", False)),
               "attn_implementation": spec.get("attn_implementation", "auto"),
               "use_cpu": trainer.args.use_cpu, "batch": trainer.args.per_device_train_batch_size},
              open(out_path, "w"))


def gradient(spec: dict, out_path: str) -> None:
    """One optimizer step's gradient, unclipped, with the batch it came from (check_trl_gradient.py).

    TRL generates and scores its first batch as in training; the un-shuffled batch
    (``_generate_and_score_completions``'s output: groups contiguous) and the rewards are recorded,
    and the gradients are read just before the optimizer step. Writes ``OUT`` (JSON: per row the
    prompt and completion token ids under their masks, reward, advantage, the loss type) and
    ``OUT.safetensors`` (the gradients by parameter name).
    """
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    rewards: list[float] = []
    scorer = make_reward(spec["reward"])

    def reward(prompts, completions, **kw):
        out = scorer(prompts, completions, **kw)
        rewards.extend(out)
        return out

    reward.__name__ = spec["reward"]
    trainer = make_trainer(dict(spec, steps=1), reward=reward, max_grad_norm=1e9)
    batches: list[dict] = []
    inner = trainer._generate_and_score_completions

    def keep(*a, **k):
        out = inner(*a, **k)
        batches.append({name: value.detach().clone() for name, value in out.items() if hasattr(value, "detach")})
        return out

    trainer._generate_and_score_completions = keep
    grads: dict = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            for name, p in trainer.model.named_parameters():
                if p.grad is not None:
                    grads[name] = p.grad.detach().clone().contiguous()

    trainer.add_callback(Grab())
    trainer.train()
    b = batches[0]
    rows = []
    for i in range(len(b["prompt_ids"])):
        pm, cm = b["prompt_mask"][i].bool(), b["completion_mask"][i].bool()
        rows.append({"prompt_ids": b["prompt_ids"][i][pm].tolist(),
                     "completion_ids": b["completion_ids"][i][cm].tolist(),
                     "reward": float(rewards[i]), "advantage": float(b["advantages"][i])})
    save_file(grads, out_path + ".safetensors")
    json.dump({"rows": rows, "loss_type": trainer.args.loss_type,
               "scale_rewards": str(trainer.args.scale_rewards), "group_size": spec["group_size"]},
              open(out_path, "w"))


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    (gradient if spec.get("mode") == "gradient" else train)(spec, sys.argv[2])


if __name__ == "__main__":
    main()
