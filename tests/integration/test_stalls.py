"""Issue 38 through real processes: when progress stops, each process says on one line what it
waits on (the ``stalled`` event, ``ctl status``'s ``waiting_on``, the ``slipstream_waiting_on``
and ``slipstream_stalled_seconds`` gauges), writes its stacks after ``dump_after_s``, ends with
exit code 7 after ``abort_after_s``, and says when progress resumes.

- no rollout server ever connects: a real ``slipstream learner`` alone;
- a server that takes work and never returns it: the learner and a protocol-level client that
  holds its assignments (tests/integration/load_kit.py ``hoarder``);
- a reward that always raises: ``slipstream run`` with a reward plug-in raising ValueError (and
  the stop for it turned off): the learner's line names the failures and the last error;
- a reward that blocks: ``slipstream run`` whose reward waits on a file: the server names the
  reward scoring and the learner the server holding the work; SIGUSR1 shows the reward's frame;
  the file released, both say progress resumed and training goes on;
- a learner that never answers: a real ``slipstream rollout`` connected to a ROUTER socket that
  reads and never replies.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import yaml
import zmq
import zmq.asyncio
from config_kit import nested, rollout_nested
from load_kit import control_status, event_line, hoarder, scrape

from protocol.plumbing.watchdog import EXIT_STALLED

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "deploy.cli"]
PORTS = {"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0}


def learner_alone(tmp_path: Path, model: str, env: dict, groups, **learner):
    cfg = {"model": model, "learner": nested({
        **PORTS, "total_steps": 1000, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4,
        "run_dir": str(tmp_path / "run"), "save_every": 0, "threads": 1, "lease_timeout_s": 600,
        "server_timeout_s": 600, **learner})}
    (tmp_path / "learner.yaml").write_text(yaml.safe_dump(cfg))
    proc = groups.watch([*CLI, "learner", "--config", str(tmp_path / "learner.yaml")], env=env, cwd=tmp_path)
    return proc, proc.wait_for_event("ready", 120)


def test_no_server_ever_connects(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    """The learner says it waits for servers (line, ctl status, gauges), dumps its stacks once the
    stall passes dump_after_s (its train task waits in next_batch), and ends with exit code 7 and
    the diagnosis as its last line at abort_after_s."""
    # abort_after_s leaves ~10 s between the stalled event and the exit for the status, metrics
    # and stack checks below (6 s left ~5 s: a loaded machine could lose the race).
    learner, ready = learner_alone(tmp_path, tiny_model_dir, subprocess_env, process_groups,
                                   watchdog={"stall_s": 1.0, "dump_after_s": 2.0, "abort_after_s": 12.0})
    stalled = learner.wait_for(event_line("stalled"), 30, "a stalled event")
    assert stalled["reason"] == "no_servers", stalled
    assert re.fullmatch(r"no step for \d+ s: waiting for samples: no rollout server is connected to "
                        + re.escape(ready["rollout"]) + r" \(none has since the start\); the buffer "
                        r"holds 0 of the 8 samples a step needs", stalled["diagnosis"]), stalled
    status = control_status(ready["control"])
    assert status["waiting_on"] and "no rollout server is connected" in status["waiting_on"], status
    assert status["watchdog"]["stalled"] and status["watchdog"]["reason"] == "no_servers", status
    m = scrape(ready["metrics"])
    assert m['slipstream_waiting_on{process="learner",reason="no_servers"}'] == 1, m
    assert m['slipstream_waiting_on{process="learner",reason="samples"}'] == 0, m
    assert m['slipstream_stalled_seconds{process="learner"}'] >= 1, m
    dumped = learner.wait_for(event_line("stacks_written"), 30, "the stall's stack dump")
    assert dumped["why"].startswith("stalled"), dumped
    text = Path(dumped["path"]).read_text()
    assert Path(dumped["path"]).parent == tmp_path / "run" / "stacks"
    assert "## task train" in text and "in next_batch" in text, text[-3000:]
    assert learner.proc.wait(timeout=60) == EXIT_STALLED, learner.output()
    lines = [line.strip() for line in learner.read_to_end() if line.strip()]
    assert re.fullmatch(r"slipstream learner: stalled \d+ s \(watchdog\.abort_after_s 12\), exiting with "
                        r"code 7: no step for \d+ s: waiting for samples: no rollout server is "
                        r"connected to .*", lines[-1]), lines[-5:]


def test_a_server_that_holds_its_work(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    """A server takes work, heartbeats and never returns it: the learner names it and what it
    holds; the stall clears its gauge when the learner is stopped (no stall while stopping)."""
    learner, ready = learner_alone(tmp_path, tiny_model_dir, subprocess_env, process_groups,
                                   watchdog={"stall_s": 2.0})
    got: dict = {}

    async def scenario() -> dict:
        ctx = zmq.asyncio.Context()
        stop = asyncio.Event()
        task = asyncio.create_task(hoarder(ctx, ready["rollout"], "holder-0", stop, got))
        try:
            return await asyncio.to_thread(learner.wait_for, event_line("stalled"), 60, "a stalled event")
        finally:
            stop.set()
            await task
            ctx.term()

    stalled = asyncio.run(scenario())
    assert stalled["reason"] == "samples", stalled
    stacks = process_groups.run([*CLI, "ctl", "--run-dir", str(tmp_path / "run"), "stacks"], timeout=60,
                                env=subprocess_env)
    dump = Path(re.search(r"^path +(\S+)$", stacks.stdout, re.M).group(1)).read_text()
    assert "## task train" in dump and "await self.buffer.next_batch" in dump, dump[-3000:]
    held = got["samples"]
    assert re.fullmatch(r"no step for \d+ s: waiting for samples: 1 rollout server connected, no valid "
                        r"sample yet; the buffer holds 0 of the 8 samples a step needs; holder-0: "
                        rf"{held} samples leased, \d+ credits, last message \d+ s ago", stalled["diagnosis"]), (
        stalled, got)
    learner.proc.send_signal(signal.SIGTERM)
    assert learner.proc.wait(timeout=60) == 0, learner.output()


RAISING_REWARD = '''
def broken(prompt, completion, metadata):
    raise ValueError("the grader's table is empty")
'''

BLOCKING_REWARD = '''
import os
import time


def held(prompt, completion, metadata):
    """0.0 once the file named by $SLIPSTREAM_TEST_RELEASE exists (bounded: 120 s)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["SLIPSTREAM_TEST_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0.0
'''


def run_with_reward(tmp_path: Path, model: str, env: dict, groups, reward: str, source: str,
                    **learner):
    (tmp_path / "stall_reward.py").write_text(source)
    cfg = {"model": model,
           "learner": nested({**PORTS, "total_steps": 1000, "batch_prompts": 1, "group_size": 2,
                              "max_new_tokens": 4, "run_dir": str(tmp_path / "run"), "save_every": 0,
                              "watchdog": {"stall_s": 3.0}, **learner}),
           "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 4, "reward": f"stall_reward:{reward}",
                       "reward_timeout_s": 600, "watchdog": {"stall_s": 3.0}}),
           "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
               SLIPSTREAM_TEST_RELEASE=str(tmp_path / "release"))
    return groups.watch([*CLI, "run", "--config", str(tmp_path / "run.yaml")], env=env, cwd=tmp_path)


def test_a_reward_that_always_raises(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    """With the stop for it off, the learner's line names the failures by reason and the
    plug-in's last error, and the server it comes from."""
    run = run_with_reward(tmp_path, tiny_model_dir, subprocess_env, process_groups, "broken",
                          RAISING_REWARD, servers={"no_valid_sample_timeout_s": 0})
    line = run.wait_for_line(r"\[learner\] stalled: (no step for .*failed samples.*)", 240).group(1)
    assert re.fullmatch(r"no step for \d+ s: waiting for samples: 1 rollout server connected, no valid "
                        r"sample yet; the buffer holds 0 of the 2 samples a step needs; failed samples: "
                        r"\d+ reward \(\d+ since the last valid one\); last error: reward broken: "
                        r"ValueError: the grader's table is empty; rollout-0: \d+ samples leased, .*",
                        line), line
    run.proc.send_signal(signal.SIGINT)
    run.proc.wait(timeout=60)


def test_a_reward_that_blocks_then_resumes(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    run = run_with_reward(tmp_path, tiny_model_dir, subprocess_env, process_groups, "held",
                          BLOCKING_REWARD)
    server_pid = int(run.wait_for_line(r"\[run\] rollout-0 pid (\d+)", 240).group(1))
    lines = {}
    for _ in range(12):                       # either may come first, and one may say it again (each
        m = run.wait_for_line(               # watchdog repeats its line while stalled) before the
            r"\[(learner)\] stalled: (.*rollout-0: .*)|\[(rollout-0)\] stalled: (.*)", 240)
        lines.setdefault(m.group(1) or m.group(3), m.group(2) or m.group(4))   # other's first comes
        if len(lines) == 2:
            break
    assert set(lines) == {"learner", "rollout-0"}, lines
    assert re.fullmatch(r"no progress for \d+ s: reward scoring has run \d+ s on one batch "
                        r"\(\d+ samples\)", lines["rollout-0"]), lines
    assert re.fullmatch(r"no step for \d+ s: waiting for samples: 1 rollout server connected, no valid "
                        r"sample yet; the buffer holds 0 of the 2 samples a step needs; rollout-0: "
                        r"\d+ samples leased, \d+ credits, last message \d+ s ago", lines["learner"]), lines
    # The blocked frame: faulthandler's part names the reward's line.
    os.kill(server_pid, signal.SIGUSR1)
    run.wait_for_line(r"\[rollout-0\] stacks_written", 60)
    threads = tmp_path / "run" / "stacks" / f"stacks-rollout-0-{server_pid}.threads.txt"
    assert re.search(r'File ".*stall_reward\.py", line \d+ in held', threads.read_text()), threads.read_text()
    (tmp_path / "release").touch()
    resumed = {run.wait_for_line(r"\[(learner|rollout-0)\] progress_resumed", 120).group(1)
               for _ in range(2)}
    assert resumed == {"learner", "rollout-0"}
    run.wait_for_line(r"^\s+2\s", 120)                         # training goes on
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=60) == 130, run.output()


def test_a_learner_that_never_answers(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    """A server whose learner reads its Hello and never replies: it says so, and its gauge too."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    cfg = {"learner": endpoint, "server_id": "lonely", "metrics_port": 0, "threads": 1,
           "learner_timeout_s": 30, "watchdog": {"stall_s": 1.0}}
    (tmp_path / "rollout.yaml").write_text(yaml.safe_dump({"model": tiny_model_dir, "rollout": rollout_nested(cfg)}))
    server = process_groups.watch([*CLI, "rollout", "--config", str(tmp_path / "rollout.yaml")],
                                  env=subprocess_env, cwd=tmp_path)
    ready = server.wait_for_event("ready", 120)
    try:
        assert silent.poll(30_000), "no Hello"
        silent.recv_multipart()
        stalled = server.wait_for(event_line("stalled"), 30, "a stalled event")
        assert stalled["reason"] == "learner" and stalled["process"] == "lonely", stalled
        assert re.fullmatch(rf"no progress for \d+ s: the learner at {re.escape(endpoint)} has not "
                            r"answered Hello for \d+ s", stalled["diagnosis"]), stalled
        m = scrape(ready["metrics"])
        assert m['slipstream_waiting_on{process="lonely",reason="learner"}'] == 1, m
        assert m['slipstream_stalled_seconds{process="lonely"}'] >= 1, m
        server.proc.send_signal(signal.SIGUSR1)     # its stacks: the receive loop waits on the learner
        written = server.wait_for(event_line("stacks_written"), 30, "the stack dump")
        dump = Path(written["path"]).read_text()
        assert Path(written["path"]).parent == tmp_path, written
        assert re.search(r"## task recv.*\n(.*\n)*.*recv_multipart", dump), dump[-3000:]
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
        silent.close(0)
        ctx.term()
