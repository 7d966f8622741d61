"""`slipstream run` is secure by default (issue 31.7): CURVE on every socket with keys it generates
into RUN_DIR/keys (directory 0700, secret keys 0600). Its own servers train, `slipstream ctl
--run-dir` (the same user) gets in, a client without the keys — another local user, a stray
script — gets no answer from any socket. `launcher.secure: false` is the old plain run."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time

import pytest
import zmq

import protocol

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "deploy.cli"]
SMALL = ["--set", "learner.network.rollout_port=0", "--set", "learner.network.weights_port=0",
         "--set", "learner.network.control_port=0", "--set", "learner.network.metrics_port=0",
         "--set", "rollout.network.metrics_port=0", "--set", "learner.batch.batch_prompts=2",
         "--set", "learner.batch.group_size=4", "--set", "rollout.generation.max_concurrency=8",
         "--set", "learner.total_steps=1000000"]


def _plain_reply(endpoint: str, msg, timeout_ms: int = 3000):
    """What a client without keys gets for ``msg``: the decoded reply, or None (no answer)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)     # a refused handshake leaves no peer: never block
    sock.connect(endpoint)
    try:
        try:
            sock.send_multipart(protocol.encode(msg))
        except zmq.Again:
            return None
        return protocol.decode(sock.recv_multipart()) if sock.poll(timeout_ms) else None
    finally:
        sock.close(0)
        ctx.term()


def _start(tmp_path, subprocess_env, process_groups, *extra):
    run_dir = tmp_path / "run"
    run = process_groups.watch([*CLI, "run", *SMALL, "--set", f"learner.run_dir={run_dir}", *extra],
                               env=subprocess_env, cwd=tmp_path)
    deadline = time.monotonic() + 300                 # learner.json: the learner is serving
    while not (run_dir / "learner.json").exists():
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output(60)
        time.sleep(0.1)
    return run, run_dir, json.loads((run_dir / "learner.json").read_text())


def _ctl(run_dir, env, *args):
    return subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), *args], capture_output=True,
                          text=True, env=env, timeout=60)


def test_run_is_secure_by_default(tmp_path, subprocess_env, process_groups):
    run, run_dir, info = _start(tmp_path, subprocess_env, process_groups)
    keys = run_dir / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    secrets = sorted(keys.glob("*.key_secret"))
    assert [p.name for p in secrets] == ["learner.key_secret", "operator.key_secret", "rollout.key_secret"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in secrets)
    assert info.get("curve_public_key")
    deadline = time.monotonic() + 300                 # its own server trains through the keys
    while (r := _ctl(run_dir, subprocess_env, "get", "version")).returncode == 0 and int(r.stdout) < 1:
        assert time.monotonic() < deadline, run.output(60)
        time.sleep(0.5)
    assert r.returncode == 0, r                        # the operator key was found by itself
    # without the keys: no answer on the control socket, none on the rollout socket
    assert _plain_reply(info["control"], protocol.ControlRequest(command="status")) is None
    hello = protocol.Hello(server_id="intruder", engine="x", model="x", version=0, max_concurrency=8)
    assert _plain_reply(info["rollout"], hello) is None
    # interrupted, cleanly: a whole `slipstream run` takes 8.6-9.2 s to stop here (the servers' drain,
    # the final checkpoint, the report), too close to the default 10 s grace (a CI run failed on it)
    assert process_groups.stop(run.proc, grace_s=60) == 130, run.output(60)


def test_launcher_secure_false_is_a_plain_run(tmp_path, subprocess_env, process_groups):
    run, run_dir, info = _start(tmp_path, subprocess_env, process_groups, "--set", "launcher.secure=false")
    assert "curve_public_key" not in info and not (run_dir / "keys").exists()
    reply = _plain_reply(info["control"], protocol.ControlRequest(command="get", args={"key": "version"}))
    assert isinstance(reply, protocol.ControlReply) and reply.ok
    # interrupted, cleanly: a whole `slipstream run` takes 8.6-9.2 s to stop here (the servers' drain,
    # the final checkpoint, the report), too close to the default 10 s grace (a CI run failed on it)
    assert process_groups.stop(run.proc, grace_s=60) == 130, run.output(60)
