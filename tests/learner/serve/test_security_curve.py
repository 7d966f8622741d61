"""R5 through real sockets: with CURVE on, a client without an allowed key can neither push
results, nor fetch weights, nor change settings or stop the run; with keys, a real rollout server
(tiny model) trains with the learner and `slipstream ctl` works. Plus the defaults: CURVE off,
everything on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import yaml
import zmq
import zmq.asyncio
from config_kit import nested, rollout_config
from learner_testkit import learner_config, metric, wait_until
from zmq.utils.monitor import parse_monitor_message

import protocol
from deploy.config_file import SlipstreamConfig
from deploy.curve_keys import generate
from learner.config import LearnerConfig
from learner.serve.service import LearnerService
from protocol.plumbing.curve import CurveClient, load_key_pair, load_public_key
from protocol.plumbing.sockets import make_socket
from rollout_server.service import RolloutService

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def test_defaults_are_loopback_and_curve_off():
    learner, rollout = LearnerConfig(), rollout_config()
    assert learner.network.bind_host == learner.network.metrics_host == rollout.network.metrics_host == "127.0.0.1"
    assert rollout.learner.startswith("tcp://127.0.0.1:")
    assert learner.security.curve is False and rollout.security.curve is False


def test_curve_needs_its_key_files():
    with pytest.raises(ValueError, match="secret_key_file and allowed_clients_dir"):
        LearnerConfig(**nested(security={"curve": True}))
    with pytest.raises(ValueError, match="learner_public_key_file"):
        rollout_config(security={"curve": True, "secret_key_file": "x"})


def test_keys_command_writes_the_layout_and_never_overwrites(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "deploy.cli", "keys", str(tmp_path / "k"), "--client", "r0",
           "--client", "r1", "--operator", "ops"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    k = tmp_path / "k"
    assert sorted(p.name for p in (k / "clients").iterdir()) == ["r0.key", "r1.key"]
    assert sorted(p.name for p in (k / "operators").iterdir()) == ["ops.key"]
    for name in ("learner", "r0", "r1", "ops"):
        assert stat.S_IMODE((k / f"{name}.key_secret").stat().st_mode) == 0o600
        public, _ = load_key_pair(k / f"{name}.key_secret", "test")
        assert load_public_key(k / f"{name}.key", "test") == public
    # The printed snippet is a config that validates (its paths exist).
    snippet = r.stdout[r.stdout.index("learner:"):]
    cfg = SlipstreamConfig.model_validate(yaml.safe_load(snippet))
    assert cfg.learner.security.curve and cfg.rollout.security.curve
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr and again.stdout == ""
    assert len(again.stderr.strip().splitlines()) == 1


def test_bad_key_files_are_startup_errors(tmp_path):
    (tmp_path / "junk.key_secret").write_text("nothing here\n")
    with pytest.raises(protocol.StartupError, match="holds no CURVE key"):
        load_key_pair(tmp_path / "junk.key_secret", "x")
    with pytest.raises(protocol.StartupError, match="cannot read key file"):
        load_key_pair(tmp_path / "missing", "x")
    generate(tmp_path / "k", ["r"], [])
    with pytest.raises(protocol.StartupError, match="no CURVE secret key"):
        load_key_pair(tmp_path / "k" / "r.key", "x")            # the public half
    # A bare Z85 secret key (a k8s Secret value) works, and yields the same public key.
    public, secret = load_key_pair(tmp_path / "k" / "r.key_secret", "x")
    (tmp_path / "bare").write_bytes(secret + b"\n")
    assert load_key_pair(tmp_path / "bare", "x") == (public, secret)


# ---- through real sockets -------------------------------------------------------------------

async def refused(endpoint: str, frames_list: list[list[bytes]], curve: CurveClient | None) -> int:
    """Connect (CURVE keys or none), send ``frames_list``; the handshake-failure event the client
    sees (a bounded wait). Asserts that no reply ever came back."""
    ctx = zmq.asyncio.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, max_message_bytes=1 << 20, curve=curve)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)    # one handshake: a reconnect would be denied again
    monitor = sock.get_monitor_socket(FAILED)
    try:
        sock.connect(endpoint)
        for frames in frames_list:
            try:
                # Never wait for a peer: once the handshake has failed (reconnects off) the socket
                # has none, and a blocking send would wait forever. A send that cannot be queued
                # means the refusal already happened; the monitor below still has to report it.
                await sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        assert await monitor.poll(20_000), f"{endpoint}: no handshake failure within 20 s"
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        assert not await sock.poll(0), "a refused client got a reply"
        return event
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def ctl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "ctl", *args]


async def run_ctl(*args: str, env: dict) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, ctl_cmd(*args), capture_output=True, text=True,
                                   env=env, timeout=60)


@pytest.mark.slow
async def test_curve_lets_in_only_allowed_keys(tmp_path, tiny_model_dir):
    keys = tmp_path / "keys"
    generate(keys, clients=["rollout"], operators=["operator"])
    generate(tmp_path / "other", clients=["intruder"], operators=[])        # a key nobody allowed
    cfg = learner_config(tmp_path, security={
        "curve": True, "secret_key_file": str(keys / "learner.key_secret"),
        "allowed_clients_dir": str(keys / "clients"), "control_allowed_dir": str(keys / "operators")})
    svc = LearnerService(cfg, tiny_model_dir, run_id="curve")
    learner = asyncio.create_task(svc.run())
    await asyncio.wait([learner, asyncio.create_task(svc.ready.wait())], timeout=120,
                       return_when=asyncio.FIRST_COMPLETED)
    assert svc.ready.is_set(), learner.exception() if learner.done() else "learner not ready"
    # Defaults bind loopback: every socket, and the HTTP endpoint.
    for name, s in svc.sockets.items():
        assert s.sock.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://127.0.0.1:"), name
    assert svc.endpoints["metrics"].startswith("http://127.0.0.1:")
    info = json.loads((svc.run_dir / "learner.json").read_text())
    assert info["curve_public_key"].encode() == load_public_key(keys / "learner.key", "t")

    # With its keys, a real rollout server connects, fetches weights and trains.
    server = RolloutService(rollout_config(
        learner=svc.endpoints["rollout"], server_id="r0", metrics_port=0, threads=1,
        max_concurrency=4, security={"curve": True,
                                     "secret_key_file": str(keys / "rollout.key_secret"),
                                     "learner_public_key_file": str(keys / "learner.key")}),
        tiny_model_dir)
    server_task = asyncio.create_task(server.run())
    try:
        await wait_until(lambda: server.engine.version >= 2 or server_task.done(), 240,
                         "the CURVE server applied version 2")
        assert not server_task.done()
        server.stopping.set()
        server.abort.set()
        assert await asyncio.wait_for(server_task, 60) == 0
        assert server.metrics.error_count("learner_handshake") == 0

        before = {k: metric(svc, k) for k in ("slipstream_rollouts_received_total",
                                              "slipstream_credits_refused_total")}
        errors = {n: metric(svc, "slipstream_protocol_errors_total", socket=n) for n in svc.sockets}
        learner_key = load_public_key(keys / "learner.key", "t")
        intruder = CurveClient(*load_key_pair(tmp_path / "other" / "intruder.key_secret", "t"),
                               server_key=learner_key)
        rollout_key = CurveClient(*load_key_pair(keys / "rollout.key_secret", "t"), server_key=learner_key)
        hello = protocol.encode(protocol.Hello(server_id="evil", engine="e", model="m", version=0,
                                               max_concurrency=4))
        result = protocol.encode(protocol.RolloutResult(server_id="evil", samples=[protocol.Sample(
            sample_id="curve-a1/0", assignment_id="curve-a1", group_index=0, group_size=2,
            prompt_token_ids=np.ones(2, np.int32), completion_token_ids=np.ones(2, np.int32),
            behavior_logprobs=np.full(2, -1.0, np.float32), token_versions=np.zeros(2, np.int32),
            reward=1.0)]))
        fetch = protocol.encode(protocol.WeightChunkRequest(version=svc.version, index=0))
        stop = protocol.encode(protocol.ControlRequest(command="stop"))
        setting = protocol.encode(protocol.ControlRequest(command="set", args={"key": "max_staleness",
                                                                               "value": 5}))
        e = svc.endpoints
        # No CURVE at all: the handshake fails on the mechanism, nothing reaches the learner.
        for endpoint, frames in ((e["rollout"], [hello, result]), (e["weights"], [fetch]),
                                 (e["control"], [setting, stop])):
            assert await refused(endpoint, frames, None) != zmq.EVENT_HANDSHAKE_FAILED_AUTH
        # A valid CURVE key that is not allowed: refused by the learner's ZAP handler, counted.
        for endpoint, frames in ((e["rollout"], [hello, result]), (e["weights"], [fetch]),
                                 (e["control"], [setting, stop])):
            assert await refused(endpoint, frames, intruder) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        # The rollout servers' key is not an operator's: no settings, no stop.
        assert await refused(e["control"], [setting, stop], rollout_key) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        await wait_until(lambda: metric(svc, "slipstream_auth_denied_total", socket="control") == 2, 10,
                         "both control refusals counted")
        assert [metric(svc, "slipstream_auth_denied_total", socket=n) for n in ("rollout", "weights")] == [1, 1]
        assert not learner.done() and not svc.stopping.is_set()
        assert svc.cfg.staleness.max_staleness == 1 and "evil" not in {s.server_id for s in svc.admission.servers.values()}
        assert {k: metric(svc, k) for k in before} == before
        assert {n: metric(svc, "slipstream_protocol_errors_total", socket=n) for n in svc.sockets} == errors

        # slipstream ctl: without a key, with an unknown key, with the rollout key -> refused (2);
        # with the operator's key (learner key from learner.json) -> works, and stops the run.
        env = dict(os.environ, PYTHONPATH=REPO)
        env.pop("SLIPSTREAM_CTL_SECRET_KEY", None)
        run_dir = ["--run-dir", str(svc.run_dir), "--timeout-s", "20"]
        for extra in ([], ["--secret-key", str(tmp_path / "other" / "intruder.key_secret")],
                      ["--secret-key", str(keys / "rollout.key_secret")]):
            r = await run_ctl(*run_dir, *extra, "stop", env=env)
            assert r.returncode == 2 and "slipstream ctl:" in r.stderr and r.stdout == "", r.stderr
        assert not svc.stopping.is_set()
        op = ["--secret-key", str(keys / "operator.key_secret")]
        r = await run_ctl(*run_dir, *op, "--json", "set", "max_staleness", "2", env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["staleness.max_staleness"] == 2 == svc.cfg.staleness.max_staleness
        r = await run_ctl("--endpoint", e["control"], "--learner-key", str(keys / "learner.key"),
                          *op, "stop", env=env)
        assert r.returncode == 0, r.stderr
        assert await asyncio.wait_for(learner, 60) == 0
    finally:
        svc.stopping.set()
        if not server_task.done():
            server.stopping.set()
            server.abort.set()
            await asyncio.wait_for(server_task, 60)
        await asyncio.wait_for(learner, 60)
