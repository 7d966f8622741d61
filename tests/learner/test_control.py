"""Control without a socket: commands, validation through the pydantic config, the buffer told."""

from __future__ import annotations

import pytest

import protocol
from buffer import RolloutBuffer
from learner.config import LearnerConfig
from learner.control import Control, describe
from learner.metrics import LearnerMetrics


@pytest.fixture
def ctl():
    cfg = LearnerConfig(max_staleness=2, group_size=2, batch_prompts=2)
    buf = RolloutBuffer(batch_samples=cfg.batch_samples, group_size=2, max_staleness=2)
    state = {"stopped": 0, "after_set": 0}

    async def after_set():
        state["after_set"] += 1

    c = Control(cfg, buf, metrics=LearnerMetrics(), status=lambda: {"version": 7},
                stop=lambda: state.__setitem__("stopped", state["stopped"] + 1), after_set=after_set)
    c.state = state
    return c


async def run(c: Control, command: str, **args) -> protocol.ControlReply:
    return await c.request(protocol.ControlRequest(command=command, args=args))


async def test_status_lists_what_is_settable(ctl):
    reply = await run(ctl, "status")
    assert reply.ok
    assert reply.result["version"] == 7
    assert reply.result["settable"] == ["max_staleness", "stale_policy"]
    assert reply.result["max_staleness"] == 2 and reply.result["stale_policy"] == "drop"


async def test_good_set_changes_config_buffer_and_gauge(ctl):
    reply = await run(ctl, "set", key="max_staleness", value="0")     # ctl sends strings
    assert reply.ok and reply.result["max_staleness"] == 0
    assert ctl.cfg.max_staleness == 0 and ctl.buffer.max_staleness == 0
    assert ctl.metrics.value("slipstream_max_staleness") == 0
    reply = await run(ctl, "set", key="stale_policy", value="correct")
    assert reply.ok and ctl.cfg.stale_policy == "correct" and ctl.buffer.stale_policy == "correct"
    assert ctl.state["after_set"] == 2


@pytest.mark.parametrize("key, value, says", [
    ("max_staleness", "-1", ["greater than or equal to 0", "max_staleness takes an integer >= 0"]),
    ("max_staleness", "1.5", ["valid integer", "max_staleness takes an integer >= 0"]),
    ("max_staleness", None, ["max_staleness takes an integer >= 0"]),
    ("stale_policy", "sometimes", ["'drop' or 'correct'", "stale_policy takes one of drop, correct"]),
])
async def test_bad_value_is_refused_with_what_the_key_takes(ctl, key, value, says):
    before = getattr(ctl.cfg, key)
    reply = await run(ctl, "set", key=key, value=value)
    assert not reply.ok
    for text in says:
        assert text in reply.error
    assert getattr(ctl.cfg, key) == before
    assert (ctl.buffer.max_staleness, ctl.buffer.stale_policy) == (2, "drop")
    assert ctl.state["after_set"] == 0


@pytest.mark.parametrize("args", [{"key": "lr", "value": "1"}, {"key": 3, "value": "1"}])
async def test_unknown_setting_names_the_settable_ones(ctl, args):
    reply = await run(ctl, "set", **args)
    assert not reply.ok and "settable: max_staleness, stale_policy" in reply.error
    assert ctl.cfg.lr == 3e-4


async def test_set_without_value_says_what_it_takes(ctl):
    reply = await run(ctl, "set", key="max_staleness")
    assert not reply.ok and "{key, value}" in reply.error


async def test_get_one_key_and_unknown_key(ctl):
    assert (await run(ctl, "get", key="lr")).result == {"lr": 3e-4}
    assert (await run(ctl, "get")).result["settable"] == ["max_staleness", "stale_policy"]
    bad = await run(ctl, "get", key="nope")
    assert not bad.ok and "max_staleness" in bad.error


async def test_stop_and_unknown_command(ctl):
    assert (await run(ctl, "stop")).result == {"stopping": True} and ctl.state["stopped"] == 1
    bad = await run(ctl, "reboot")
    assert not bad.ok and bad.error.endswith("commands: status, get, set, stop")


async def test_wrong_message_type_is_a_protocol_error(ctl):
    with pytest.raises(protocol.ProtocolError, match="control socket"):
        await ctl.handle(b"x", protocol.Heartbeat(sender_id="s", version=0))


def test_describe_reads_the_field_definition():
    assert describe("max_staleness") == "an integer >= 0"
    assert describe("stale_policy") == "one of drop, correct"
    assert describe("top_p") == "a number >= 1e-09 and <= 1"
