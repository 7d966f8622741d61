"""Checkpoints and resume (learner/state/checkpoint.py): the resume oracle on the tiny model (fp32, CPU),
atomicity (torn checkpoints skipped, keep_last), crafted checkpoints refused with one line, a full
disk or an unwritable directory, and a learner service stopped and resumed in-process."""

from __future__ import annotations

import asyncio
import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from config_kit import nested
from learner_testkit import HonestServer, ctl, learner_config, metric, wait_until

import learner.state.checkpoint as ckpt_mod
from buffer import Batch
from learner.config import LearnerConfig, TrainerConfig
from learner.serve.service import LearnerService
from learner.state.checkpoint import Checkpointer, effective_trained_ids
from learner.train.trainer import Trainer
from protocol import Sample
from protocol.errors import StartupError

GROUP, B, VOCAB = 4, 8, 49
STATE = {"run_id": "oracle", "assignment_counter": 7, "data": {"position": 3}, "buffer": {}}


def make_batch(version: int, seed: int) -> Batch:
    """A fixed batch of 2 groups x 4 (ragged rows, rewards that differ within each group)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(B):
        g, gi = divmod(i, GROUP)
        p, t = 2 + (i * 3) % 4, 1 + (i * 5) % 6
        prompt = np.concatenate([[1], rng.integers(4, VOCAB, p)]).astype(np.int32)
        samples.append(Sample(
            sample_id=f"s{seed}-a{g}/{gi}", assignment_id=f"s{seed}-a{g}", group_index=gi,
            group_size=GROUP, prompt_token_ids=prompt,
            completion_token_ids=rng.integers(4, VOCAB, t).astype(np.int32),
            behavior_logprobs=(-np.log(VOCAB) + 0.5 * rng.standard_normal(t)).astype(np.float32),
            token_versions=np.full(t, version, dtype=np.int32), reward=float(rng.random())))
    return Batch(samples, version=version, staleness=[0] * B, needs_correction=[False] * B,
                 group_sizes=[GROUP, GROUP])


def trainer_cfg(**overrides) -> LearnerConfig:
    cfg = dict(group_size=GROUP, batch_prompts=B // GROUP, micro_batch_samples=4, lr=1e-2, seed=0,
               threads=1, total_steps=10)
    cfg.update(overrides)
    return LearnerConfig(**nested(cfg))


def all_params(tr: Trainer) -> dict[str, torch.Tensor]:
    out = {f"policy.{n}": p.detach().clone() for n, p in tr.model.named_parameters()}
    if tr.critic is not None:
        out.update({f"critic.{n}": p.detach().clone() for n, p in tr.critic.named_parameters()})
    return out


CONFIGS = {
    "grpo": {},
    "ppo_gae_critic": {"advantage": "gae", "ppo_epochs": 2},
    "adaptive_kl": {"kl_coef": 0.05, "kl_controller": "adaptive", "kl_target": 0.01,
                    "kl_horizon": 10.0},
    "lora": {"lora": {"r": 4, "alpha": 8.0}, "lr": 5e-2, "kl_coef": 0.05},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_oracle_same_next_step(tmp_path, tiny_model_dir, name):
    """Train k steps, checkpoint, restore into a fresh Trainer, apply the same next batch in both:
    the same loss (1e-6) and the same parameters afterwards. A trainer given only the weights (no
    optimizer state) does not match: the check can fail."""
    cfg = trainer_cfg(**CONFIGS[name])
    a = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    for v in range(3):
        a.step(make_batch(v, seed=v))
    store = Checkpointer(tmp_path / "ck", keep_last=2)
    path = store.save(3, STATE, a)
    assert path.name == "step-3" and (path / "COMPLETE").is_file()
    policy_file = "adapter_model.safetensors" if name == "lora" else "model.safetensors"
    assert (path / "policy" / policy_file).is_file()              # loadable by transformers as is

    b = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    store.restore_trainer(store.read(store.latest_complete()), b)
    before_a, before_b = all_params(a), all_params(b)
    assert before_a.keys() == before_b.keys()
    assert all(torch.equal(before_a[k], before_b[k]) for k in before_a)
    if name == "adaptive_kl":
        assert b.kl_controller.value == a.kl_controller.value != 0.05     # it adapted, and came back
    assert b.reward_moments.state_dict() == a.reward_moments.state_dict()

    nxt = make_batch(3, seed=99)
    sa, sb = a.step(nxt), b.step(nxt)
    assert abs(sa["loss"] - sb["loss"]) <= 1e-6, (sa["loss"], sb["loss"])
    pa, pb = all_params(a), all_params(b)
    worst = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert worst <= 1e-6, worst

    # The negative control: the same weights without the optimizer state train differently.
    c = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    ckpt_mod.load_policy(c.model, path / "policy")
    assert all(torch.equal(before_a[k], p) for k, p in all_params(c).items() if k.startswith("policy."))
    c.step(nxt)
    pc = all_params(c)
    assert max(float((pa[k] - pc[k]).abs().max()) for k in pa if k.startswith("policy.")) > 1e-4


def test_checkpoint_loads_with_from_pretrained(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    tr = Trainer(TrainerConfig.of(trainer_cfg()), tiny_model_dir)
    tr.step(make_batch(0, seed=0))
    path = Checkpointer(tmp_path / "ck").save(1, STATE, tr)
    loaded = AutoModelForCausalLM.from_pretrained(path / "policy", dtype=torch.float32)
    for (n, p), (_, q) in zip(tr.model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_lora_checkpoint_holds_the_adapter_only_and_refuses_a_full_config(tmp_path, tiny_model_dir):
    tr = Trainer(TrainerConfig.of(trainer_cfg(lora={"r": 4, "alpha": 8.0})), tiny_model_dir)
    tr.step(make_batch(0, seed=0))
    store = Checkpointer(tmp_path / "ck")
    path = store.save(1, STATE, tr)
    assert not (path / "policy" / "model.safetensors").exists()
    assert (path / "policy" / "adapter_config.json").is_file()
    full = Trainer(TrainerConfig.of(trainer_cfg()), tiny_model_dir)
    with pytest.raises(StartupError, match="LoRA adapter"):
        store.restore_trainer(store.read(path), full)


def test_resume_flags_parse():
    from deploy.cli import build_parser

    p = build_parser()
    assert p.parse_args(["learner", "--config", "c.yaml", "--resume"]).resume == "latest"
    assert p.parse_args(["learner", "--config", "c.yaml", "--resume", "/x/step-4"]).resume == "/x/step-4"
    assert p.parse_args(["run", "--resume"]).resume == "latest"
    assert p.parse_args(["run"]).resume is None


def test_prepare_copies_so_training_may_go_on_while_commit_writes(tmp_path, tiny_model_dir):
    """prepare() reads the trainer; a step taken before commit() does not leak into the checkpoint."""
    cfg = trainer_cfg()
    a = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    a.step(make_batch(0, seed=0))
    at_1 = all_params(a)
    moments = [st["exp_avg"].clone() for st in a.optimizer.state.values()]
    store = Checkpointer(tmp_path / "ck")
    pending = store.prepare(1, STATE, a)
    a.step(make_batch(1, seed=1))                                 # training goes on meanwhile
    path = store.commit(pending)
    b = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    store.restore_trainer(store.read(path), b)
    assert all(torch.equal(at_1[k], v) for k, v in all_params(b).items())
    assert all(torch.equal(m, st["exp_avg"]) for m, st in zip(moments, b.optimizer.state.values(), strict=True))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model_dir):
    """A trainer after one step and a complete checkpoint of it (copied by the tests that break it)."""
    root = tmp_path_factory.mktemp("saved")
    tr = Trainer(TrainerConfig.of(trainer_cfg()), tiny_model_dir)
    tr.step(make_batch(0, seed=0))
    path = Checkpointer(root / "ck").save(1, STATE, tr)
    return tr, path


def test_torn_checkpoints_are_skipped_and_keep_last_is_honoured(tmp_path, saved):
    tr, _ = saved
    store = Checkpointer(tmp_path / "ck", keep_last=2)
    for v in (1, 2, 3):
        store.save(v, STATE, tr)
    assert [v for v, _ in store.complete()] == [2, 3]             # step-1 deleted after step-3
    # Torn: a newer directory without its marker, another with a marker that is not JSON, and a
    # temporary directory of a write that never finished.
    torn = tmp_path / "ck" / "step-9"
    shutil.copytree(tmp_path / "ck" / "step-3", torn)
    (torn / "COMPLETE").unlink()
    (torn / "trainer.safetensors").write_bytes(b"\0" * 10)        # partial file
    bad_marker = tmp_path / "ck" / "step-8"
    shutil.copytree(tmp_path / "ck" / "step-3", bad_marker)
    (bad_marker / "COMPLETE").write_text("{not json")
    (tmp_path / "ck" / ".tmp-step-10-abc").mkdir()
    assert store.latest_complete() == tmp_path / "ck" / "step-3"
    assert store.resolve(None) == tmp_path / "ck" / "step-3"
    with pytest.raises(StartupError, match="no valid COMPLETE marker"):
        store.read(torn)                                          # named explicitly: refused too
    store.clean_temporary()
    assert not (tmp_path / "ck" / ".tmp-step-10-abc").exists()
    empty = Checkpointer(tmp_path / "none")
    with pytest.raises(StartupError, match="no complete checkpoint"):
        empty.resolve("latest")


def _break(path: Path, how: str) -> None:
    files = json.loads((path / "manifest.json").read_text())["files"]
    if how == "no_marker":
        (path / "COMPLETE").unlink()
    elif how == "format_version":
        m = json.loads((path / "COMPLETE").read_text())
        (path / "COMPLETE").write_text(json.dumps({**m, "format_version": 99}))
    elif how == "bad_json":
        _rewrite_consistently(path, "state.json", b"{\"run_id\": ")
    elif how == "missing_file":
        (path / "trainer.safetensors").unlink()
    elif how == "lying_manifest":       # a file changed after the manifest was written
        p = path / "trainer.json"
        p.write_bytes(p.read_bytes().replace(b"0", b"1", 1))
    elif how == "lying_version":        # consistent checksums, but state.json says another version
        state = json.loads((path / "state.json").read_text())
        _rewrite_consistently(path, "state.json", json.dumps({**state, "version": 5}).encode())
    elif how == "shape_mismatch":       # a crafted tensor file, checksums updated to match
        from safetensors.torch import load_file, save_file
        t = load_file(str(path / "policy" / "model.safetensors"))
        key = next(k for k in t if t[k].dim() == 2)
        t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
        save_file(t, str(path / "policy" / "model.safetensors"))
        _rewrite_consistently(path, "policy/model.safetensors", None)
    elif how == "optimizer_shape":
        from safetensors.torch import load_file, save_file
        t = load_file(str(path / "trainer.safetensors"))
        key = next(k for k in t if k.startswith("/optimizer/state/") and t[k].dim() == 2)
        t[key] = torch.zeros(3, 3)
        save_file(t, str(path / "trainer.safetensors"))
        _rewrite_consistently(path, "trainer.safetensors", None)
    elif how == "escape":               # the manifest names a file outside the checkpoint
        m = json.loads((path / "manifest.json").read_text())
        m["files"]["../../etc/passwd"] = {"bytes": 1, "xxh3_128": "0"}
        _rewrite_manifest(path, m)
    else:
        raise AssertionError(how)
    assert files


def _rewrite_consistently(path: Path, rel: str, data: bytes | None) -> None:
    """Replace a file and update the manifest and marker so the checksums agree (a crafted one)."""
    if data is not None:
        (path / rel).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    raw = (path / rel).read_bytes()
    m["files"][rel] = {"bytes": len(raw), "xxh3_128": xxhash.xxh3_128_hexdigest(raw)}
    _rewrite_manifest(path, m)


def _rewrite_manifest(path: Path, manifest: dict) -> None:
    raw = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(raw)
    marker = json.loads((path / "COMPLETE").read_text())
    (path / "COMPLETE").write_text(json.dumps({**marker, "manifest_digest": xxhash.xxh3_128_hexdigest(raw)}))


@pytest.mark.parametrize("how, message", [
    ("no_marker", "no valid COMPLETE marker"),
    ("format_version", "format_version|version 99"),
    ("bad_json", "state.json is not JSON"),
    ("missing_file", "trainer.safetensors is missing"),
    ("lying_manifest", "does not match its checksum"),
    ("lying_version", "versions do not agree"),
    ("shape_mismatch", "has shape"),
    ("optimizer_shape", "has shape"),
    ("escape", "outside the checkpoint"),
])
def test_crafted_or_corrupt_checkpoint_is_refused_with_one_line(tmp_path, saved, tiny_model_dir,
                                                                how, message):
    _, good = saved
    path = tmp_path / "step-1"
    shutil.copytree(good, path)
    _break(path, how)
    store = Checkpointer(tmp_path)
    fresh = Trainer(TrainerConfig.of(trainer_cfg()), tiny_model_dir) if how in ("shape_mismatch", "optimizer_shape") else None
    with pytest.raises(StartupError, match=message) as err:
        store.restore_trainer(store.read(path), fresh) if fresh is not None else store.read(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"checkpoint {path}:"), text


def test_a_config_that_does_not_fit_is_refused(tmp_path, saved, tiny_model_dir):
    """A checkpoint without a critic into a config with one: one line, before anything runs."""
    _, good = saved
    store = Checkpointer(good.parent)
    critic = Trainer(TrainerConfig.of(trainer_cfg(advantage="gae")), tiny_model_dir)
    with pytest.raises(StartupError, match="critic") as err:
        store.restore_trainer(store.read(good), critic)
    assert "\n" not in str(err.value)


def test_disk_full_leaves_the_previous_checkpoint_and_no_temporary(tmp_path, saved, monkeypatch):
    tr, _ = saved
    store = Checkpointer(tmp_path / "ck")
    store.save(1, STATE, tr)
    real = ckpt_mod._write_bytes

    def full(path, data):
        if Path(path).name == "state.json":
            real(path, data[: len(data) // 2])                     # half written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_bytes", full)
    with pytest.raises(OSError) as err:
        store.save(2, STATE, tr)
    assert err.value.errno == errno.ENOSPC
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-1"]
    store.read(tmp_path / "ck" / "step-1")                         # intact


# ---- through a real learner service --------------------------------------------------------------

async def _serve_until(svc: LearnerService, version: int) -> None:
    async with HonestServer(svc.endpoints["rollout"]) as good:
        await good.wait_version(version, timeout_s=120)


async def _start(svc: LearnerService) -> asyncio.Task:
    task = asyncio.create_task(svc.run())
    ready = asyncio.create_task(svc.ready.wait())
    await asyncio.wait([task, ready], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if not svc.ready.is_set():
        ready.cancel()
        task.result()
        raise AssertionError("learner not ready")
    return task


async def test_service_stops_with_a_checkpoint_and_resumes_where_it_was(tmp_path, tiny_model_dir):
    """Periodic checkpoints, a final one at the stop, and a second learner resumed from it: same run
    id, version, data position, assignment counter, gate totals and de-duplication window; it trains
    on and trained_ids.jsonl is appended to."""
    cfg = learner_config(tmp_path, save_every=2, keep_last=2, batch_prompts=2)
    svc = LearnerService(cfg, tiny_model_dir, run_id="life")
    task = await _start(svc)
    await _serve_until(svc, 5)
    await wait_until(lambda: svc.checkpoints.saved_version >= 4, 30, "a periodic checkpoint")
    svc.stopping.set()
    assert await asyncio.wait_for(task, 60) == 0
    v = svc.version
    assert v >= 5 and svc.checkpoints.saved_version == v          # the stop saved what it trained
    store = svc.checkpoints.store
    assert store.latest_complete().name == f"step-{v}" and len(store.complete()) == 2
    saved_state = store.read(store.latest_complete()).state     # (the live buffer moved on: leases lost)
    before = saved_state["buffer"]
    position, counter = saved_state["data"]["position"], saved_state["assignment_counter"]
    assert metric(svc, "slipstream_checkpoint_version") == v
    assert metric(svc, "slipstream_checkpoint_seconds_count") >= 2

    cfg2 = learner_config(tmp_path, save_every=2, keep_last=2, batch_prompts=2)
    again = LearnerService(cfg2, tiny_model_dir, resume="latest")
    restored = {}
    apply = again.checkpoints.apply

    def apply_and_look(ckpt, **describe):
        # The buffer as the resume left it, before the train task (started with the service) can
        # take a restored full batch or the first server re-send work.
        apply(ckpt, **describe)
        restored["buffer"] = again.buffer.state_dict(binary=False)
        restored["counter"] = again.assignment_counter
        restored["version"] = again.version
    again.checkpoints.apply = apply_and_look
    task2 = await _start(again)
    try:
        assert (again.run_id, restored["version"]) == ("life", v)
        assert again.prompts.state_dict()["position"] == position  # (no server yet: none issued)
        assert restored["counter"] == counter
        after = restored["buffer"]
        for key in ("seen", "closed"):                            # the de-duplication windows
            # (a restored lease already over the staleness limit may be dropped at once: appended)
            assert after[key][:len(before[key])] == before[key], key
        # (a restored group already over the staleness limit at the resumed version is dropped at
        # once, in the resume's staleness.set, as a continuing run would have dropped it: its
        # samples leave accepted_total)
        delta = {k: after["counters"][k] - before["counters"][k] for k in before["counters"]}
        dropped = delta["dropped_stale"] + delta["dropped_incomplete"]
        assert after["gate"]["accepted_total"] == before["gate"]["accepted_total"] - dropped
        assert after["gate"]["consumed_total"] == before["gate"]["consumed_total"]
        # (the saved leases are lost at a restart: the next expiry counts them; dropping a partly
        # filled group returns the rest of its capacity; nothing else moves)
        moved = {k for k, d in delta.items() if d}
        assert moved <= {"expired", "dropped_stale", "dropped_incomplete", "abandoned"}, moved
        first = again.offers.next_assignment()                           # the data order continues
        assert first.assignment_id == f"life-a{counter + 1}" and first.prompt_id == f"p{position}"
        again.assignment_counter -= 1                             # (not issued: put the id back)
        again.prompts.load_state_dict({**again.prompts.state_dict(), "position": position})
        await _serve_until(again, v + 2)
    finally:
        again.stopping.set()
        assert await asyncio.wait_for(task2, 60) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "trained_ids.jsonl").read_text().splitlines()]
    resumed = [i for i, r in enumerate(lines) if "resumed_at_version" in r]
    assert len(resumed) == 1 and lines[resumed[0]]["resumed_at_version"] == v
    assert [r["trained_on_version"] for r in lines[:resumed[0]]] == list(range(v))
    assert lines[resumed[0] + 1]["trained_on_version"] == v
    ids = effective_trained_ids(tmp_path / "run" / "trained_ids.jsonl")
    assert len(ids) == len(set(ids)) == again.version * cfg.batch.batch_samples


async def test_unwritable_checkpoint_dir_is_an_error_event_and_training_goes_on(tmp_path, tiny_model_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = learner_config(tmp_path, save_every=1, checkpoint_dir=str(blocker / "ck"))
    svc = LearnerService(cfg, tiny_model_dir, run_id="ro")
    events = []
    log = svc.checkpoints.log
    svc.checkpoints.log = lambda event, **kw: (events.append((event, kw)), log(event, **kw))[1]
    task = await _start(svc)
    await _serve_until(svc, 3)                                    # trains on past the failures
    svc.stopping.set()
    assert await asyncio.wait_for(task, 60) == 0
    failed = [kw for e, kw in events if e == "checkpoint_failed"]
    assert failed and failed[0]["errno"] in ("ENOTDIR", "EEXIST") and failed[0]["level"] == "error"
    assert metric(svc, "slipstream_checkpoint_failures_total") == len(failed) >= 2


async def test_disk_full_under_checkpoint_failure_stop_stops_cleanly(tmp_path, tiny_model_dir, monkeypatch):
    """The second periodic checkpoint finds the disk full: under checkpoint_failure: stop the learner
    stops by itself, cleanly (exit code 3, no traceback), the first checkpoint intact."""
    real, calls = ckpt_mod._save_tensors, []

    def full_after_one(tensors, path):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(ckpt_mod, "_save_tensors", full_after_one)
    cfg = learner_config(tmp_path, save_every=2, checkpoint_failure="stop")
    svc = LearnerService(cfg, tiny_model_dir, run_id="full")
    task = await _start(svc)
    async with HonestServer(svc.endpoints["rollout"]):
        code = await asyncio.wait_for(task, 120)                 # the run stops by itself
    assert code == ckpt_mod.EXIT_CHECKPOINT_FAILED
    assert svc.version >= 4 and metric(svc, "slipstream_checkpoint_failures_total") == 1
    root = svc.checkpoints.store.root
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]  # intact, no temporary left
    svc.checkpoints.store.read(root / "step-2")


async def test_the_end_of_training_is_checkpointed(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, total_steps=3, save_every=0, exit_on_finish=True, final_sync_s=0.1)
    svc = LearnerService(cfg, tiny_model_dir, run_id="end")
    task = await _start(svc)
    async with HonestServer(svc.endpoints["rollout"]):
        assert await asyncio.wait_for(task, 120) == 0
    store = svc.checkpoints.store
    assert [v for v, _ in store.complete()] == [3]                # save_every 0: only the end
    assert store.read(store.latest_complete()).state["run_id"] == "end"


async def test_ctl_checkpoint_writes_one_between_steps(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, save_every=0)
    svc = LearnerService(cfg, tiny_model_dir, run_id="ctl")
    task = await _start(svc)
    try:
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(2)
            reply = await ctl(svc.endpoints["control"], "checkpoint", timeout_s=60)
            assert reply.ok, reply.error
            assert reply.result["reason"] == "ctl" and reply.result["version"] >= 2
            path = Path(reply.result["checkpoint"])
            ck = svc.checkpoints.store.read(path)                 # complete and verified
            assert ck.state["version"] == reply.result["version"] == int(path.name.split("-")[1])
    finally:
        svc.stopping.set()
        assert await asyncio.wait_for(task, 60) == 0


async def test_periodic_checkpoint_is_written_beside_training(tmp_path, tiny_model_dir, monkeypatch):
    """The optimizer tensors' write is held until the learner has trained two more steps: training
    did not wait for it, and the checkpoint still completes with the version it was taken at."""
    import threading

    real, release, held = ckpt_mod._save_tensors, threading.Event(), []

    def slow(tensors, path):
        held.append(path)
        assert release.wait(60)
        real(tensors, path)

    monkeypatch.setattr(ckpt_mod, "_save_tensors", slow)
    cfg = learner_config(tmp_path, save_every=2)
    svc = LearnerService(cfg, tiny_model_dir, run_id="beside")
    task = await _start(svc)
    try:
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await wait_until(lambda: held, 60, "the first checkpoint's write")
            await good.wait_version(4)                            # trained on while it is held
            assert svc.checkpoints.saved_version == 0 and svc.checkpoints.pending is not None
            release.set()
            info = await asyncio.wait_for(svc.checkpoints.pending, 60)
            assert info["version"] == 2 and info["pause_s"] <= info["seconds"]
            assert svc.checkpoints.store.read(Path(info["checkpoint"])).state["version"] == 2
    finally:
        release.set()
        svc.stopping.set()
        assert await asyncio.wait_for(task, 60) == 0


def test_what_the_first_save_would_import_is_imported_at_load(tmp_path, tiny_model_dir):
    """save_pretrained imports DeepSpeed on first use (accelerate's unwrap); the learner imports it
    at load (warm_save_imports), so the first periodic checkpoint does not pause training for it.
    In a fresh interpreter: not imported before, imported after, and a save then imports nothing."""
    import subprocess
    import sys

    code = f"""
import sys
from transformers import AutoModelForCausalLM
from learner.state.checkpoint import warm_save_imports
m = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})
assert "deepspeed" not in sys.modules
warm_save_imports()
before = set(sys.modules)
m.save_pretrained({str(tmp_path / "saved")!r})
print("deepspeed" in before, sorted(n for n in set(sys.modules) - before if "deepspeed" in n))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True []"


async def test_a_resumed_run_keeps_its_run_id_in_evaluation_ids_too(tmp_path, tiny_model_dir):
    """After --resume every id the learner hands out carries the resumed run id: training
    assignments and evaluation rounds alike (the evaluation once took the new life's id, because it
    was built before the checkpoint's run state was applied)."""
    cfg = learner_config(tmp_path, batch_prompts=2)
    svc = LearnerService(cfg, tiny_model_dir, run_id="life")
    task = await _start(svc)
    await _serve_until(svc, 2)
    svc.stopping.set()
    assert await asyncio.wait_for(task, 60) == 0
    assert svc.checkpoints.saved_version >= 2

    cfg2 = learner_config(tmp_path, batch_prompts=2, eval_data="builtin:arith", eval_prompts=2, eval_every=1000)
    again = LearnerService(cfg2, tiny_model_dir, resume="latest")     # a new life, no run id given
    task2 = await _start(again)
    try:
        assert again.run_id == "life" and again.state.version == svc.version
        assert again.evaluation.owns("life-e0.0") and not again.evaluation.owns(f"{svc.run_id}x-e0.0")
        assert again.evaluation.prefix == "life-e"
        assert again.offers.next_assignment().assignment_id.startswith("life-a")
    finally:
        again.stopping.set()
        assert await asyncio.wait_for(task2, 60) == 0


def test_the_run_state_loads_only_a_run_state():
    from learner.state.run_state import RunState

    run = RunState("fresh")
    run.load_state_dict({"run_id": "life", "version": 7, "assignment_counter": 30, "data": {}})
    assert run.state_dict() == {"run_id": "life", "version": 7, "assignment_counter": 30}
    assert run.next_assignment_id() == "life-a31"
    for bad in ({"run_id": "", "version": 1, "assignment_counter": 0},
                {"run_id": "x", "version": -1, "assignment_counter": 0},
                {"run_id": "x", "version": True, "assignment_counter": 0},
                {"run_id": 3, "version": 1, "assignment_counter": 0},
                {"version": 1, "assignment_counter": 0}):
        with pytest.raises((ValueError, KeyError)):
            run.load_state_dict(bad)
        assert run.state_dict() == {"run_id": "life", "version": 7, "assignment_counter": 31}
