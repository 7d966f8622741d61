"""Control without a socket: commands, validation through the pydantic config, the buffer told."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from config_kit import nested

import protocol
from buffer import RolloutBuffer
from learner.config import LearnerConfig, get_path, resolve_key
from learner.metrics import LearnerMetrics
from learner.serve.control import Control, describe


@pytest.fixture
def ctl():
    cfg = LearnerConfig(**nested(max_staleness=2, group_size=2, batch_prompts=2))
    buf = RolloutBuffer(batch_samples=cfg.batch.batch_samples, group_size=2, max_staleness=2)
    state = {"stopped": 0, "after_set": 0}

    async def dispatch():
        state["after_set"] += 1

    process = SimpleNamespace(status=lambda: {"version": 7}, dump_stacks=dict, has_reference=lambda: True,
                              stop=lambda: state.__setitem__("stopped", state["stopped"] + 1))
    c = Control(cfg, buf, metrics=LearnerMetrics(), process=process,
                admission=SimpleNamespace(pause=lambda paused: None, dispatch=dispatch))
    c.state = state
    return c


SETTABLE = ["algorithm.clip_anchor", "algorithm.is_cap", "algorithm.is_mode", "algorithm.target_kl", "kl.coef",
            "optimizer.lr", "sampling.temperature", "servers.max_inflight_per_server",
            "staleness.max_staleness", "staleness.stale_policy", "watchdog.abort_after_s",
            "watchdog.dump_after_s", "watchdog.stall_s"]


async def run(c: Control, command: str, **args) -> protocol.ControlReply:
    return await c.request(protocol.ControlRequest(command=command, args=args))


async def test_status_lists_what_is_settable(ctl):
    reply = await run(ctl, "status")
    assert reply.ok
    assert reply.result["version"] == 7
    assert reply.result["settable"] == SETTABLE
    assert reply.result["staleness.max_staleness"] == 2 and reply.result["staleness.stale_policy"] == "drop"
    assert reply.result["paused"] is False and reply.result["pending"] == {}


async def test_good_set_changes_config_buffer_and_gauge(ctl):
    reply = await run(ctl, "set", key="max_staleness", value="0")     # ctl sends strings; a unique leaf
    assert reply.ok and reply.result["staleness.max_staleness"] == 0
    assert ctl.cfg.staleness.max_staleness == 0 and ctl.buffer.max_staleness == 0
    assert ctl.metrics.value("slipstream_max_staleness") == 0
    reply = await run(ctl, "set", key="staleness.stale_policy", value="correct")     # the full path
    assert reply.ok and ctl.cfg.staleness.stale_policy == "correct" and ctl.buffer.stale_policy == "correct"
    assert ctl.state["after_set"] == 2


@pytest.mark.parametrize("key, value, says", [
    ("max_staleness", "-1", ["greater than or equal to 0", "staleness.max_staleness takes an integer >= 0"]),
    ("max_staleness", "1.5", ["valid integer", "staleness.max_staleness takes an integer >= 0"]),
    ("max_staleness", None, ["staleness.max_staleness takes an integer >= 0"]),
    ("stale_policy", "sometimes", ["'drop' or 'correct'", "staleness.stale_policy takes one of drop, correct"]),
])
async def test_bad_value_is_refused_with_what_the_key_takes(ctl, key, value, says):
    before = get_path(ctl.cfg, resolve_key(key))
    reply = await run(ctl, "set", key=key, value=value)
    assert not reply.ok
    for text in says:
        assert text in reply.error
    assert get_path(ctl.cfg, resolve_key(key)) == before
    assert (ctl.buffer.max_staleness, ctl.buffer.stale_policy) == (2, "drop")
    assert ctl.state["after_set"] == 0


@pytest.mark.parametrize("args", [{"key": "seed", "value": "1"}, {"key": 3, "value": "1"},
                                  {"key": "lora", "value": {"r": 4}}])
async def test_unknown_setting_names_the_settable_ones(ctl, args):
    reply = await run(ctl, "set", **args)
    assert not reply.ok and f"settable: {', '.join(SETTABLE)}" in reply.error
    assert ctl.cfg.seed == 0 and ctl.cfg.lora is None


async def test_set_without_value_says_what_it_takes(ctl):
    reply = await run(ctl, "set", key="max_staleness")
    assert not reply.ok and "{key, value}" in reply.error


async def test_get_one_key_and_unknown_key(ctl):
    assert (await run(ctl, "get", key="optimizer.lr")).result == {"optimizer.lr": 3e-4}
    assert (await run(ctl, "get", key="max_staleness")).result == {"staleness.max_staleness": 2}
    assert (await run(ctl, "get", key="kl")).result["kl"]["coef"] == 0.0        # a whole section
    assert (await run(ctl, "get")).result["settable"] == SETTABLE
    bad = await run(ctl, "get", key="nope")
    assert not bad.ok and "unknown key 'nope'" in bad.error
    moved = await run(ctl, "get", key="kl_coef")                          # the flat layout's name
    assert not moved.ok and moved.error == "kl_coef moved to kl.coef"
    typo = await run(ctl, "set", key="max_stalenes", value="0")
    assert not typo.ok and "did you mean staleness.max_staleness?" in typo.error


async def test_stop_and_unknown_command(ctl):
    assert (await run(ctl, "stop")).result == {"stopping": True} and ctl.state["stopped"] == 1
    bad = await run(ctl, "reboot")
    assert not bad.ok and bad.error.endswith("commands: status, get, set, pause, resume, checkpoint, stacks, stop")


async def test_wrong_message_type_is_a_protocol_error(ctl):
    with pytest.raises(protocol.ProtocolError, match="control socket"):
        await ctl.handle(b"x", protocol.Heartbeat(sender_id="s", version=0))


def test_describe_reads_the_field_definition():
    assert describe("staleness.max_staleness") == "an integer >= 0"
    assert describe("staleness.stale_policy") == "one of drop, correct"
    assert describe("sampling.top_p") == "a number >= 1e-09 and <= 1"
    assert describe("algorithm.target_kl") == "a number > 0, or null (off)"


class FakeTrainer:
    """What Control.before_step touches on the trainer: its own config copy and the KL controller
    (the real Trainer in the service test below)."""

    def __init__(self, cfg: LearnerConfig):
        import ops

        self.cfg = cfg.model_copy(deep=True)
        self.kl_controller = ops.AdaptiveKLController(0.1, 0.1, 1000.0)


async def test_step_settings_reach_the_trainer_only_between_steps(ctl):
    trainer = FakeTrainer(ctl.cfg)
    for key, value in (("is_mode", "mis"), ("is_cap", 3), ("optimizer.lr", "0.001"), ("target_kl", "null"),
                       ("target_kl", 0.05), ("kl.coef", 0.5)):
        reply = await run(ctl, "set", key=key, value=None if value == "null" else value)
        assert reply.ok, reply.error
    # The service's config changed at once; the trainer's copy not yet (a step may be running).
    assert (ctl.cfg.algorithm.is_mode, ctl.cfg.algorithm.is_cap, ctl.cfg.optimizer.lr, ctl.cfg.algorithm.target_kl) == ("mis", 3.0, 1e-3, 0.05)
    assert (trainer.cfg.algorithm.is_mode, trainer.cfg.optimizer.lr, trainer.cfg.algorithm.target_kl) == ("tis", 3e-4, None)
    assert (await run(ctl, "status")).result["pending"] == {
        "algorithm.is_mode": "mis", "algorithm.is_cap": 3.0, "optimizer.lr": 1e-3,
        "algorithm.target_kl": 0.05, "kl.coef": 0.5}
    ctl.before_step(trainer)
    assert (trainer.cfg.algorithm.is_mode, trainer.cfg.algorithm.is_cap, trainer.cfg.optimizer.lr, trainer.cfg.algorithm.target_kl,
            trainer.cfg.kl.coef) == ("mis", 3.0, 1e-3, 0.05, 0.5)
    assert trainer.kl_controller.value == 0.5
    assert (await run(ctl, "status")).result["pending"] == {}
    m = ctl.metrics
    assert m.value("slipstream_setting", {"key": "optimizer.lr"}) == 1e-3
    assert m.value("slipstream_setting", {"key": "algorithm.is_cap"}) == 3
    assert m.value("slipstream_control_changes_total", {"key": "algorithm.target_kl"}) == 2


async def test_clip_anchor_is_a_step_setting_and_refused_beside_target_kl(ctl):
    trainer = FakeTrainer(ctl.cfg)
    assert (await run(ctl, "set", key="target_kl", value=0.05)).ok
    reply = await run(ctl, "set", key="clip_anchor", value="behavior")
    assert not reply.ok and "target_kl" in reply.error and ctl.cfg.algorithm.clip_anchor == "proximal"
    assert (await run(ctl, "set", key="target_kl", value=None)).ok
    assert (await run(ctl, "set", key="clip_anchor", value="behavior")).ok
    assert trainer.cfg.algorithm.clip_anchor == "proximal"          # not before the next step
    ctl.before_step(trainer)
    assert trainer.cfg.algorithm.clip_anchor == "behavior"


async def test_kl_coef_needs_a_reference_loaded_at_start():
    cfg = LearnerConfig(**nested(group_size=2, batch_prompts=2))
    buf = RolloutBuffer(batch_samples=cfg.batch.batch_samples, group_size=2)
    c = Control(cfg, buf, metrics=LearnerMetrics(),
                process=SimpleNamespace(status=dict, stop=lambda: None, has_reference=lambda: False))
    reply = await run(c, "set", key="kl.coef", value=0.1)
    assert not reply.ok and "no reference policy" in reply.error and cfg.kl.coef == 0
    assert (await run(c, "set", key="kl.coef", value=0)).ok         # 0 stays allowed
    assert c._pending == {"kl.coef": 0.0}


async def test_pause_resume_and_checkpoint(ctl):
    calls = []
    ctl.admission.pause = calls.append
    assert not ctl.paused and ctl.resumed.is_set()
    reply = await run(ctl, "pause")
    assert reply.ok and reply.result["paused"] is True and not ctl.resumed.is_set()
    assert (await run(ctl, "pause")).ok and calls == [True]          # idempotent
    assert ctl.metrics.value("slipstream_paused") == 1
    reply = await run(ctl, "resume")
    assert reply.ok and reply.result["paused"] is False and ctl.resumed.is_set()
    assert calls == [True, False] and ctl.state["after_set"] == 1
    assert ctl.metrics.value("slipstream_paused") == 0
    bad = await run(ctl, "checkpoint")
    assert not bad.ok and "not available" in bad.error

    async def checkpoint():
        return {"path": "/x/step-3"}
    ctl.checkpoints = SimpleNamespace(request=checkpoint)
    assert (await run(ctl, "checkpoint")).result == {"path": "/x/step-3"}

    async def full_disk():
        raise OSError(28, "No space left on device")
    ctl.checkpoints = SimpleNamespace(request=full_disk)
    bad = await run(ctl, "checkpoint")
    assert not bad.ok and "No space left" in bad.error


async def test_stop_while_paused_lets_the_train_loop_go(ctl):
    await run(ctl, "pause")
    await run(ctl, "stop")
    assert ctl.resumed.is_set() and ctl.state["stopped"] == 1
