"""The learner under DeepSpeed (issue 11; CPU, gloo): the config section; one torchrun group of
two ranks shared by the two-rank checks (the equivalence oracle under ZeRO-2 with a critic, ZeRO-1
with the optimizer offloaded and ZeRO-3: one plain process's losses, statistics and updated
parameters; the rollback of a step whose later update is skipped, on every rank; every rank's RNG
states through a checkpoint, also with another rank count); one rank in this process (a skipped
non-finite step, ZeRO-3 LoRA publishing and engine state, end to end with a rollout server); and
two ranks end to end with a rollout server: ``--nproc 2`` killed after a checkpoint (the group
goes down, non-zero), resumed under the ``deepspeed`` launcher and ZeRO-3 to the last step.

Time: starting a group of ranks (imports, engines) is most of each two-rank test, so checks share
groups. DeepSpeed builds its shared-memory comm op once per machine (~35 s; minutes on 2 busy
cores), cached in ``TORCH_EXTENSIONS_DIR`` (here under the session's SLIPSTREAM_CACHE); the
optimizer is the trainer's torch AdamW (offloaded too), so no Adam op is ever built.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from config_kit import nested, rollout_nested
from learner_testkit import learner_config, running_learner, wait_until
from test_algorithms_service import jsonl, rollout_server
from test_trainer import make_batch

from learner.config import DeepSpeedSettings, LearnerConfig, TrainerConfig
from learner.train.batching import collate
from learner.train.ds_config import engine_config
from learner.train.trainer import Trainer

HERE = Path(__file__).resolve().parents[1]        # tests/learner: ds_oracle_worker.py
REPO = HERE.parents[1]
CLI = [sys.executable, "-m", "deploy.cli"]
def torchrun() -> list[str]:
    """torchrun of 2 ranks, static rendezvous on a free port (c10d's keep-alives time out on a
    loaded host)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0"]

ORACLE = {"group_size": 4, "batch_prompts": 2, "micro_batch_samples": 3, "ppo_epochs": 2,
          "kl_coef": 0.05, "lr": 1e-3, "max_grad_norm": 1e6, "seed": 0, "threads": 1, "is_cap": 2.0}
"""8 samples in micro-batches of 3 (3, 3, 2: rank 0 trains two, rank 1 one and a dummy), two epochs
(a separate proximal pass, shuffled plans, the sanity check), a KL loss to the reference; the
oracle's second step (ds_oracle_worker.SECOND_STEP, a live config change) is the single-update
shortcut without KL. ``is_cap`` 2 (the default is 5): the batch's random behavior log-probs give
weights above 2, and the larger gradients of a higher cap put ZeRO-3's fp32 reduction-order
differences at 1.2e-5 in the parameters, over TOL; the oracle is about equivalence, not the cap."""
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ds_env(subprocess_env, builtin_cache) -> dict:
    """The subprocess environment with DeepSpeed's extension cache in the session's cache."""
    env = dict(subprocess_env, TORCH_EXTENSIONS_DIR=str(Path(builtin_cache) / "torch_extensions"),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


# ---- the section --------------------------------------------------------------------------------

def test_section_becomes_the_engine_config_and_refuses_what_cannot_work():
    cfg = LearnerConfig(**nested(deepspeed={"zero_stage": 3, "precision": "bf16", "offload_optimizer": "cpu",
                                   "offload_param": "cpu"}))
    ec = engine_config(cfg.deepspeed, max_grad_norm=0.5, world_size=4)
    # slipstream's micro-batching: one "micro-batch" of one sample, one accumulation step, and
    # the trainer owns the boundary; DeepSpeed clips at max_grad_norm.
    assert ec["gradient_accumulation_steps"] == 1 and ec["train_micro_batch_size_per_gpu"] == 1
    assert ec["managed_gradient_accumulation"] is False and ec["train_batch_size"] == 4
    assert ec["gradient_clipping"] == 0.5
    assert ec["zero_optimization"]["stage"] == 3
    assert ec["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert ec["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert ec["bf16"] == {"enabled": True, "check_grad_overflow": True} and "fp16" not in ec
    assert "optimizer" not in ec                    # the trainer's torch AdamW, no fused Adam
    assert ec["zero_force_ds_cpu_optimizer"] is False   # ... offloaded too (no DeepSpeedCPUAdam)
    assert "fp16" in engine_config(DeepSpeedSettings(precision="fp16"), 1.0, 1)
    assert LearnerConfig().deepspeed is None        # absent: the plain PyTorch path
    with pytest.raises(ValueError, match="offload_param needs zero_stage: 3"):
        DeepSpeedSettings(zero_stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match="heartbeat_s"):
        DeepSpeedSettings(timeout_s=10, heartbeat_s=5)
    with pytest.raises(ValueError):
        LearnerConfig(**nested(deepspeed={"zero_stage": 4}))


def test_a_precision_the_device_cannot_run_is_a_startup_error(tiny_model_dir, builtin_cache, monkeypatch):
    """DeepSpeed's CPU accelerator has no fp16 (``deepspeed.initialize`` raises "Type fp16 is not
    supported on your device"): one line saying what to use instead, before any model loads."""
    from deepspeed.accelerator import get_accelerator

    from learner.train.distributed import make_trainer
    from protocol.errors import StartupError

    if get_accelerator().is_fp16_supported():
        pytest.skip("this accelerator runs fp16")
    _group_of_one(monkeypatch, builtin_cache)
    with pytest.raises(StartupError, match=r"precision=fp16 is not supported .* use bf16 or fp32"):
        make_trainer(TrainerConfig.of(LearnerConfig(**nested(deepspeed={"precision": "fp16"}))), tiny_model_dir)


def test_nproc_without_a_deepspeed_section_is_one_line(tmp_path, tiny_model_dir, subprocess_env,
                                                       process_groups):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": tiny_model_dir, "learner": nested({"run_dir": str(tmp_path / "run")})}))
    r = process_groups.run([*CLI, "learner", "--config", str(path), "--nproc", "2"], timeout=120,
                           env=subprocess_env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "learner.deepspeed" in lines[0], r.stderr


LEAVE = """
import torch.distributed as dist
from learner.config import LearnerConfig
from learner.train import ds_group

group = ds_group.join_group(LearnerConfig(deepspeed={"timeout_s": 60}).deepspeed)
assert dist.is_initialized() and group.world == 1
ds_group.leave_group()
assert not dist.is_initialized() and ds_group._GROUP is None
ds_group.leave_group()                  # twice: nothing left to leave
print("left")
"""


def test_leave_group_destroys_the_process_groups(ds_env, process_groups):
    """A real group of one (deepspeed.init_distributed, gloo) is gone after leave_group, and the
    process exits 0 (the groups' threads are not torn down by the interpreter's exit)."""
    env = {k: v for k, v in ds_env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    r = process_groups.run([sys.executable, "-c", LEAVE], timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("left"), r.stdout + r.stderr


@pytest.mark.parametrize(("rank", "code", "left"), [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)])
def test_the_groups_are_left_only_after_a_clean_end(monkeypatch, rank, code, left):
    """``learner.serve.service.serve`` under DeepSpeed: rank 0 (the service) and a worker leave their
    groups when they end cleanly, never after a failure (a thread may be stuck in a collective)."""
    from learner.serve import service
    from learner.train import distributed, ds_group

    calls = []

    class Run:                               # the service's or the worker's exit code
        def __init__(self, *a, **k):
            pass

        async def run(self):
            return code

    # The launcher-made group is not under test: only its rank is read.
    monkeypatch.setattr(ds_group, "join_group", lambda ds: SimpleNamespace(rank=rank))
    monkeypatch.setattr(distributed, "worker_main", lambda cfg, model, group: code)
    monkeypatch.setattr(ds_group, "leave_group", lambda: calls.append("left"))
    monkeypatch.setattr(service, "LearnerService", Run)
    assert service.serve(LearnerConfig(**nested(deepspeed={})), "unused") == code
    assert calls == (["left"] if left else [])


# ---- two ranks: the equivalence oracle, rollback, RNG states per rank ----------------------------

DS_ORACLE = {"timeout_s": 120, "heartbeat_s": 5, "publish_bucket_bytes": 64 << 10}
RUNS = {
    # ZeRO-2 with the critic (GAE: values pass, critic engine); its rollback checks poison the
    # critic: at the second of two updates (the policy's second update was applied first), and in
    # a one-update step (the policy's update is applied before the critic's norm is known).
    "zero2-critic": {"fields": {**ORACLE, "advantage": "gae", "deepspeed": {**DS_ORACLE, "zero_stage": 2}},
                     "poison": [{"fields": {"ppo_epochs": 2}, "at": 2, "which": "critic", "seed": 2},
                                {"fields": {"ppo_epochs": 1}, "at": 1, "which": "critic", "seed": 3}]},
    # ZeRO-1 with the optimizer offloaded to the CPU (the trainer's torch AdamW there: no
    # DeepSpeedCPUAdam to compile), GRPO and KL; micro-batches by a 24-token budget (each
    # epoch's rows longest first in passes of 2, 3 and 3 rows: rank 1 trains one and a dummy).
    "zero1-offload": {"fields": {**ORACLE, "micro_batch_tokens": 24,
                                 "deepspeed": {**DS_ORACLE, "zero_stage": 1, "offload_optimizer": "cpu"}},
                      "poison": [{"fields": {"ppo_epochs": 2}, "at": 2, "which": "policy", "seed": 2}]},
    # ZeRO-3 with GRPO and KL: parameters gathered in every pass, the publish in 64 KiB buckets.
    "zero3": {"fields": {**ORACLE, "deepspeed": {**DS_ORACLE, "zero_stage": 3}},
              "poison": [{"fields": {"ppo_epochs": 2, "kl_coef": 0.05}, "at": 2, "which": "policy", "seed": 2}]},
}


def _draw() -> list[float]:
    import random

    import numpy as np

    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_model_dir, builtin_cache, module_process_groups) -> dict:
    """One torchrun group of two ranks for every two-rank check (ds_oracle_worker.py: the oracle,
    rollback and RNG checks of each run in RUNS). Before it, this process (a group of one) trains
    the ZeRO-2 run's trainer a step and saves a one-rank engine state for the RNG checks; the
    trainer is kept for the checks that load the two ranks' state back here."""
    import random

    import numpy as np

    from learner.train.distributed import make_trainer

    out = tmp_path_factory.mktemp("ds-ranks")
    with pytest.MonkeyPatch.context() as mp:
        _group_of_one(mp, builtin_cache)
        one = make_trainer(TrainerConfig.of(LearnerConfig(**nested(**RUNS["zero2-critic"]["fields"]))), tiny_model_dir)
        one.step(make_batch(seed=0))
        torch.manual_seed(4000)
        random.seed(4001)
        np.random.seed(4002)
        one.save_engine_state(out / "engine-one-rank")
        one_rank_draw = _draw()
    runs = [{"name": name, **run} for name, run in RUNS.items()]
    next(r for r in runs if r["name"] == "zero2-critic")["rng"] = {"one_rank": str(out / "engine-one-rank")}
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLIPSTREAM_CACHE=str(builtin_cache),
               TORCH_EXTENSIONS_DIR=str(Path(builtin_cache) / "torch_extensions"),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = module_process_groups.run([*torchrun(), str(HERE / "ds_oracle_worker.py"), tiny_model_dir, str(out),
                                   json.dumps({"runs": runs})], timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = {name: torch.load(out / f"{name}.pt", weights_only=True) for name in RUNS}
    return {"runs": results, "out": out, "one": one, "one_rank_draw": one_rank_draw}


def _plain(model_dir: str, fields: dict, hidden: bool) -> tuple[list[dict], dict, dict]:
    """One plain process through the oracle's two steps: (stats, initial and updated tensors)."""
    tr = Trainer(TrainerConfig.of(LearnerConfig(**nested(fields))), model_dir)
    tr.forward.uses_hidden = tr.forward.uses_hidden and hidden
    initial = {n: t.detach().clone() for n, t in tr.named_tensors()}
    stats = [tr.step(make_batch(seed=0))]
    tr.cfg.batch.ppo_epochs, tr.cfg.kl.coef = 1, 0.0                   # ds_oracle_worker.SECOND_STEP
    stats.append(tr.step(make_batch(seed=1)))
    return stats, initial, {n: t.detach().clone() for n, t in tr.named_tensors()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_match_one_plain_process(two_ranks, tiny_model_dir, name):
    """Same batches, same plan: two ranks give one plain process's loss and every other step
    statistic (1e-5) and the same updated parameters (1e-5). ZeRO-2 with the critic, ZeRO-1 with
    the optimizer offloaded, ZeRO-3 with GRPO (RUNS). ZeRO-3 computes log-probs through the logits (its head weight is partitioned),
    so its plain twin does too; the plain hidden-state path agrees with it to about 1e-5 after an
    Adam step of lr 1e-3 (Adam's first step amplifies rounding of gradients near zero)."""
    got = two_ranks["runs"][name]["oracle"]
    stage = RUNS[name]["fields"]["deepspeed"]["zero_stage"]
    assert got["world"] == 2
    stats, initial, updated = _plain(tiny_model_dir, {k: v for k, v in RUNS[name]["fields"].items()
                                                      if k != "deepspeed"}, hidden=stage != 3)
    for step, (want, have) in enumerate(zip(stats, got["stats"], strict=True)):
        keys = {k for k in want if not k.startswith("time_") and k != "step_s"}
        assert keys == {k for k in have if not k.startswith("time_") and k != "step_s"}
        off = {k: (want[k], have[k]) for k in keys if not math.isclose(want[k], have[k], rel_tol=TOL, abs_tol=TOL)}
        assert not off, (step, off)
    assert stats[0]["optimizer_steps"] == 2 and stats[1]["optimizer_steps"] == 1
    assert set(got["tensors"]) == set(updated)
    worst = max(float((updated[n].float() - got["tensors"][n]).abs().max()) for n in updated)
    moved = max(float((updated[n] - initial[n]).abs().max()) for n in updated)
    assert worst <= TOL, worst
    assert moved > 100 * TOL, moved                  # the comparison is of parameters that moved
    if stage == 3:
        n_bytes = sum(t.numel() * 4 for t in updated.values())
        assert got["gather"]["bytes"] == n_bytes
    print(f"{name}: max |param diff| {worst:.2e}, largest update {moved:.2e}, gather {got['gather']}")


@pytest.mark.slow
def test_a_later_skipped_update_rolls_back_the_step_on_every_rank(two_ranks):
    """A step of two updates whose second gets a NaN gradient on rank 1 only: DeepSpeed declines
    the reduced update on both ranks, and every rank puts back what the first update changed —
    its parameters (ZeRO-3: its partitions), float32 masters, Adam moments and step counts, bit
    for bit (the first update had moved them). ZeRO-2 poisons the critic (the policy's second
    update was applied before the critic's norm was known), ZeRO-1 with the optimizer offloaded
    (masters and moments in CPU memory) and ZeRO-3 the policy; and a one-update
    step whose critic is poisoned undoes the policy's update of that step."""
    for name, run in RUNS.items():
        ranks = two_ranks["runs"][name]["ranks"]
        assert len(ranks) == 2
        for i, (spec, *per_rank) in enumerate(zip(run["poison"], *(r["rollback"] for r in ranks), strict=True)):
            n = spec["fields"]["ppo_epochs"]
            for rank, got in enumerate(per_rank):
                where = (name, i, rank)
                assert f"non-finite {spec['which']} gradient norm" in got["reason"], (where, got)
                assert f"at update {spec['at']} of {n}" in got["reason"], (where, got)
                assert got["applied_before_skip"] == spec["at"] - 1, (where, got)
                assert got["compared"] > 10 and got["changed"] == [], (where, got["changed"][:5])
                if spec["at"] > 1:
                    assert got["moved_before_skip"] > 1e-5, (where, got)


@pytest.mark.slow
def test_each_rank_gets_its_own_rng_states_back(two_ranks):
    """RNG states per rank (learner.train.distributed): two ranks seeded apart save an engine state,
    draw (torch, python, numpy), reseed and load it back: each rank draws what it drew without
    the interruption, and the ranks' draws differ. Another rank count: loading the two ranks'
    state here (one rank) gives rank 0's back; two ranks loading a one-rank state give rank 0
    that rank's states and seed rank 1 from (learner.seed, 1)."""
    from learner.train.ds_group import rank_seed, seed_rank

    ranks = [r["rng"] for r in two_ranks["runs"]["zero2-critic"]["ranks"]]
    for r in ranks:
        assert r["resumed"] == r["uninterrupted"]
    assert ranks[0]["uninterrupted"] != ranks[1]["uninterrupted"]
    # One rank from the two ranks' state: rank 0's.
    one = two_ranks["one"]
    torch.manual_seed(9)
    one.load_engine_state(two_ranks["out"] / "engine-two-ranks")
    assert _draw() == ranks[0]["uninterrupted"]
    # Two ranks from a one-rank state: rank 0 its own, rank 1 the rule.
    assert ranks[0]["from_one_rank"] == two_ranks["one_rank_draw"]
    seed_rank(ORACLE["seed"], 1)
    assert ranks[1]["from_one_rank"] == _draw() != ranks[0]["from_one_rank"]
    assert len({rank_seed(0, 0), rank_seed(0, 1), rank_seed(1, 1), rank_seed(1, 0)}) == 4
    assert rank_seed(0, 1) == rank_seed(0, 1) < 1 << 63


# ---- end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_non_finite_loss_is_skipped_and_its_gradients_dropped(tiny_model_dir, builtin_cache, monkeypatch):
    """ZeRO-2: a NaN reward makes the loss non-finite; the step is skipped on every rank with the
    plain path's reason, nothing changes, and the gradients already reduced into DeepSpeed's
    partitions are dropped (its overflow path). Then the trainer's first applied update: a step of
    two updates whose second backs a NaN gradient; the rollback puts the Adam state the first one
    made back to Adam's initial one. The next good step ends where a fresh trainer's does, bit for
    bit (stale NaN gradients would make it NaN, the first update's moments elsewhere)."""
    from learner.train.distributed import make_trainer
    from learner.train.step import SkippedStep

    _group_of_one(monkeypatch, builtin_cache)
    cfg = LearnerConfig(**nested(**{**ORACLE, "ppo_epochs": 1}, reward_norm="running", deepspeed={"zero_stage": 2}))
    a = make_trainer(TrainerConfig.of(cfg), tiny_model_dir)
    before = {n: t.clone() for n, t in a.named_tensors()}
    bad = make_batch()
    bad.samples[3].reward = float("nan")
    with pytest.raises(SkippedStep, match="non-finite loss at update 1 of 1"):
        a.step(bad)
    assert all(torch.equal(before[n], t) for n, t in a.named_tensors())
    assert a.reward_moments.count == 0
    seen = {"updates": 0}
    accumulate, backward = a._accumulate, a.strategy.backward

    def counting(*args, **kwargs):
        seen["updates"] += 1
        return accumulate(*args, **kwargs)

    a._accumulate = counting
    a.strategy.backward = lambda loss, which: backward(loss * (float("nan") if seen["updates"] == 2 else 1.0), which)
    a.cfg.batch.ppo_epochs = 2
    with pytest.raises(SkippedStep, match="non-finite policy gradient norm .* at update 2 of 2"):
        a.step(make_batch(seed=2))
    del a._accumulate, a.strategy.backward
    a.cfg.batch.ppo_epochs = 1
    assert seen["updates"] == 2 and all(torch.equal(before[n], t) for n, t in a.named_tensors())
    assert all(float(st["step"]) == 0 for st in a.optimizer.state.values())
    a.step(make_batch(seed=1))
    b = make_trainer(TrainerConfig.of(cfg), tiny_model_dir)
    b.step(make_batch(seed=1))
    tb = dict(b.named_tensors())
    assert all(torch.equal(t, tb[n]) for n, t in a.named_tensors())


def _group_of_one(monkeypatch, builtin_cache) -> None:
    """This process as a group of one (the env a launcher would set; the group, once made, stays)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path(builtin_cache) / "torch_extensions"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(_free_port())).items():
            monkeypatch.setenv(k, v)


@pytest.mark.slow
def test_zero3_lora_publishes_the_adapter_and_the_engine_state_resumes_exactly(tmp_path, tiny_model_dir,
                                                                               builtin_cache, monkeypatch):
    """ZeRO-3 with LoRA: a publish carries the adapter's tensors only (under the names a plain
    LoRA trainer publishes), gathered from the partitions. The engine state of a checkpoint
    (master weights and Adam moments) loaded into a fresh trainer gives it the same published
    weights (a fresh trainer's are the initial ones, over 1e-3 away) and, one step later on the
    same batch, the same parameters, bit for bit (zero Adam moments would step elsewhere)."""
    from learner.train.distributed import make_trainer

    _group_of_one(monkeypatch, builtin_cache)
    cfg = LearnerConfig(**nested(**{**ORACLE, "ppo_epochs": 1, "lr": 1e-2}, lora={"r": 4},
                        deepspeed={"zero_stage": 3, "publish_bucket_bytes": 4096}))
    plain_names = [n for n, _ in Trainer(TrainerConfig.of(LearnerConfig(**nested(**{**ORACLE, "lora": {"r": 4}}))), tiny_model_dir).named_tensors()]
    a = make_trainer(TrainerConfig.of(cfg), tiny_model_dir)
    before = dict(a.named_tensors())
    a.step(make_batch(seed=0))
    after = dict(a.named_tensors())
    assert a.publish_kind == "lora" and list(after) == plain_names
    assert all("lora_" in n for n in after)
    assert max(float((after[n] - before[n]).abs().max()) for n in after) > 1e-3
    a.save_engine_state(tmp_path / "engine")
    b = make_trainer(TrainerConfig.of(cfg), tiny_model_dir)
    b.load_engine_state(tmp_path / "engine")
    assert all(torch.equal(t, after[n]) for n, t in b.named_tensors())
    a.step(make_batch(seed=1))
    b.step(make_batch(seed=1))
    ta, tb = dict(a.named_tensors()), dict(b.named_tensors())
    assert all(torch.equal(ta[n], tb[n]) for n in ta)



@pytest.mark.slow
async def test_one_rank_zero2_trains_and_the_server_applies_every_version(tmp_path, tiny_model_dir,
                                                                          builtin_cache, monkeypatch):
    """ZeRO-2 in this process (a group of one): with max_staleness 0 every batch at version v was
    sampled from version v's published weights, so the server's behavior log-probs are the
    learner's own at the step's start; the server applies every version up to the last."""
    _group_of_one(monkeypatch, builtin_cache)
    steps = 3
    cfg = learner_config(tmp_path, deepspeed={"zero_stage": 2}, max_staleness=0, batch_prompts=2,
                         group_size=2, total_steps=steps, lr=1e-2, final_sync_s=10.0,
                         entropy_coef=0.05)       # a gradient at every step, whatever the rewards
    gaps: list[float] = []
    async with running_learner(cfg, tiny_model_dir) as svc:
        tr = svc.trainer
        assert type(tr.strategy).__name__ == "DeepSpeedStrategy" and tr.strategy.engine.zero_optimization_stage() == 2
        step = tr.step

        def checking_step(batch):
            bt = collate(batch.samples, tr.pad_id)
            tr.model.eval()
            with torch.no_grad():
                lp = tr.forward(bt.input_ids, bt.attention_mask, bt.targets, tr.cfg.sampling.temperature)[0]
            tr.model.train()
            gaps.append(float((lp - bt.behavior_logprobs)[bt.mask.bool()].abs().max()))
            return step(batch)

        tr.step = checking_step
        async with rollout_server(svc, tiny_model_dir) as server:
            await wait_until(lambda: svc.finished, timeout_s=180, what="the last step")
            await wait_until(lambda: server.engine.version == steps, 60, "the last version applied")
    assert len(gaps) == steps and max(gaps) < 1e-4, gaps
    rows = jsonl(cfg)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Every step moved the weights (lr 1e-2), far more than the 1e-4 the behavior log-probs
    # are allowed: a server that missed a version would be off by much more.
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows), rows
    assert (Path(cfg.run_dir) / "final" / "config.json").exists()


def _two_rank_config(tmp_path, model: str, stage: int, total_steps: int,
                     save_every: int = 0) -> tuple[str, int]:
    port = _free_port()
    cfg = {
        "model": model,
        "learner": nested({"rollout_port": port, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                    "total_steps": total_steps, "batch_prompts": 2, "group_size": 2,
                    "micro_batch_samples": 1, "max_new_tokens": 4, "max_staleness": 1,
                    "run_dir": str(tmp_path / "run"), "save_every": save_every, "threads": 1,
                    "final_sync_s": 20, "reannounce_s": 1.0,
                    "deepspeed": {"zero_stage": stage, "timeout_s": 60, "heartbeat_s": 5,
                                  "publish_bucket_bytes": 64 << 10}}),
        "rollout": rollout_nested({"learner": f"tcp://127.0.0.1:{port}", "metrics_port": 0, "max_concurrency": 4,
                    "heartbeat_interval_s": 0.5, "reconnect_ivl_s": 0.05, "reconnect_ivl_max_s": 0.5,
                    "threads": 1, "drain_timeout_s": 5}),
    }
    path = tmp_path / "ds.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), port


def _event(line: str) -> dict | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def _is(event: str, **want):
    """A line matcher: the event ``event`` (its dict) whose fields satisfy ``want`` (a value, or a
    predicate)."""
    def match(line: str):
        ev = _event(line)
        if not ev or ev.get("event") != event:
            return None
        ok = all(v(ev.get(k)) if callable(v) else ev.get(k) == v for k, v in want.items())
        return ev if ok else None
    return match


@pytest.mark.slow
def test_two_ranks_train_end_to_end_die_together_and_resume_under_the_deepspeed_launcher(tmp_path, tiny_model_dir, ds_env,
                                                                        process_groups):
    """Two ranks and a real ``slipstream rollout`` server, one group of each life (starting a
    group is most of the cost):

    - ``slipstream learner --nproc 2`` (torchrun), ZeRO-2, a checkpoint every step: the server
      applies the published versions; rank 1 stopped with SIGSTOP is named by rank 0's watchdog
      (issue 38) and training resumes after SIGCONT; SIGKILL of rank 1 after a checkpoint makes torchrun end
      rank 0 too and exit non-zero (no rank waits forever in a collective);
    - ``deepspeed --num_gpus 2 --no_local_rank --module deploy.cli learner ... --resume`` (the
      deepspeed launcher) under ZeRO-3 (the engine state is whole tensors: another stage or rank
      count resumes it) starts from the last complete checkpoint, the version continues,
      every publish is gathered bucket by bucket, the server applies the last version, the final
      policy is saved and the group exits 0 (rank 1 on rank 0's stop)."""
    from learner.state.checkpoint import Checkpointer

    cfg, _ = _two_rank_config(tmp_path, tiny_model_dir, stage=2, total_steps=10_000, save_every=1)
    learner = process_groups.watch([*CLI, "learner", "--config", cfg, "--nproc", "2",
                                    "--set", "learner.watchdog.stall_s=3"], env=ds_env)
    server = process_groups.watch([*CLI, "rollout", "--config", cfg, "--set", "rollout.server_id=r0"],
                                  env=ds_env)
    worker = learner.wait_for(_is("worker_ready"), 240, "rank 1 ready")
    assert worker["rank"] == 1 and worker["world"] == 2
    server.wait_for(_is("weights_applied", weights_version=lambda v: (v or 0) >= 1), 180,
                    "the server applying version 1")
    learner.wait_for(_is("checkpoint", version=lambda v: (v or 0) >= 1), 60, "a checkpoint")
    # Rank 1 stopped (SIGSTOP): rank 0's watchdog names it (its liveness file stopped), within the
    # group's timeout_s; continued, progress resumes.
    os.kill(worker["pid"], signal.SIGSTOP)
    try:
        stalled = learner.wait_for(_is("stalled", reason="rank"), 45, "rank 0 naming the stopped rank")
        # ctl stacks: rank 0 waits in a collective (its step, or the idle group's ping)
        stacks = process_groups.run([*CLI, "ctl", "--run-dir", str(tmp_path / "run"), "stacks"],
                                    timeout=60, env=ds_env)
        assert stacks.returncode == 0, stacks.stderr
        dump = Path(re.search(r"^path +(\S+)$", stacks.stdout, re.M).group(1)).read_text()
        assert "distributed_c10d.py" in dump, dump[-3000:]
    finally:
        os.kill(worker["pid"], signal.SIGCONT)
    assert re.fullmatch(rf"no step for \d+ s: waiting on DeepSpeed rank 1 \(pid {worker['pid']} on "
                        r"[^)]+\): no heartbeat for \d+ s, its last command \w+", stalled["diagnosis"]), stalled
    learner.wait_for(_is("progress_resumed", process="learner"), 60, "the step after rank 1 continued")
    os.kill(worker["pid"], signal.SIGKILL)
    code = learner.proc.wait(timeout=120)
    assert code != 0, learner.output()
    complete = Checkpointer(tmp_path / "run" / "checkpoints").complete()
    assert complete, learner.output()
    saved, latest = complete[-1]
    assert (latest / "engine" / "engine.safetensors").is_file() and (latest / "engine" / "rng.safetensors").is_file()
    last = saved + 2
    # The second life under the deepspeed launcher (CPU: --num_gpus counts ranks; --no_local_rank:
    # the ranks read LOCAL_RANK from the environment, the CLI takes no --local_rank).
    second = process_groups.watch([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                                   "--master_port", str(_free_port()), "--no_local_rank", "--module",
                                   "deploy.cli", "learner", "--config", cfg, "--resume",
                                   "--set", "learner.deepspeed.zero_stage=3",
                                   "--set", f"learner.total_steps={last}"], env=ds_env)
    resumed = second.wait_for(_is("resumed"), 240, "the resume")
    assert resumed["resumed_version"] == saved, (resumed, saved)     # the last complete checkpoint
    second.wait_for(_is("finished"), 240, "the last step")
    server.wait_for(_is("weights_applied", weights_version=last), 60, f"the server applying version {last}")
    assert second.proc.wait(timeout=60) == 0, second.output()
    process_groups.stop(server.proc, grace_s=2)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "step" in r]
    assert steps[-(last - resumed["resumed_version"]):] == list(range(resumed["resumed_version"] + 1, last + 1))
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert (tmp_path / "run" / "final" / "config.json").exists()
