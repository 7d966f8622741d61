"""Issue 31.3 and 31.4 through real processes: a fleet of identities that take work and never
return it does not starve the run, and a reward that always fails stops it with one line.

- Starving fleet: a real ``slipstream learner`` (tiny model) with the default ``learner.servers``
  guards; 20 protocol-level identities (this process) say Hello, ask for 64 samples each,
  heartbeat, apply every version, and never return an assignment; one honest client
  (tests/integration/load_client.py) joins after they hold the whole gate. The learner must keep
  training: the silent holders' leases are pre-empted long before ``lease_timeout_s`` (600 s here)
  and the waiting identities take their trials in turn (one threshold shared among them), the
  honest server gets work, and once it has returned some the fleet holds at most the trial budget
  (a quarter of the gate: one group) while the honest server trains; a 22nd identity is refused
  (``max_servers``). Before these guards the fleet held the gate until its leases timed out; with
  the allowance and pre-emption alone it took minutes for the honest server's turn to come.
- Failing reward: ``slipstream run`` with one real rollout server whose reward plug-in calls
  ``sys.exit``: the server stays up (the call fails its samples, not the process), the learner
  counts the failures by reason and stops after ``no_valid_sample_timeout_s`` with exit code 5
  and a one-line reason.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from config_kit import nested, rollout_nested
from load_kit import control_status, hoarder, scrape, start_learner, total
from run_kit import slipstream_run

import protocol

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
FLEET, MAX_SERVERS = 20, 21


def test_a_fleet_that_hoards_work_does_not_starve_the_run(tmp_path, tiny_model_dir, subprocess_env,
                                                            process_groups):
    learner, ready, lines = start_learner(tmp_path, tiny_model_dir, subprocess_env, process_groups.popen,
                                          servers={"max_servers": MAX_SERVERS})
    got: dict[str, dict] = {f"hoard-{i}": {} for i in range(FLEET + 1)}

    def fleet_holds(status: dict) -> int:
        return sum(v["outstanding"] for k, v in status["servers"].items() if k.startswith("hoard-"))

    async def scenario() -> dict:
        ctx = zmq.asyncio.Context()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(hoarder(ctx, ready["rollout"], f"hoard-{i}", stop, got[f"hoard-{i}"]))
                 for i in range(FLEET)]
        # The fleet takes the gate's whole capacity (16 samples) before an honest server is there.
        deadline = time.monotonic() + 30
        while sum(g.get("samples", 0) for g in got.values()) < 16 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        before = control_status(ready["control"])
        honest = process_groups.popen([sys.executable, str(HERE / "load_client.py"), ready["rollout"],
                                       "1", "120", str(tmp_path / "honest.json")], env=subprocess_env)
        # One identity more than max_servers: refused.
        await asyncio.sleep(1.0)
        extra = asyncio.create_task(hoarder(ctx, ready["rollout"], f"hoard-{FLEET}", stop, got[f"hoard-{FLEET}"]))
        start = time.monotonic()
        status = control_status(ready["control"])
        while time.monotonic() - start < 90 and status["version"] < 10:
            await asyncio.sleep(0.5)
            status = control_status(ready["control"])
        reached = time.monotonic() - start
        # The honest server has returned work: the fleet's share falls to the trial budget as the
        # holders it had before are pre-empted (one threshold), and training goes on meanwhile.
        while time.monotonic() - start < reached + 20 and fleet_holds(status) > 4:
            await asyncio.sleep(0.5)
            status = control_status(ready["control"])
        settled = status
        await asyncio.sleep(3.0)
        after = control_status(ready["control"])
        stop.set()
        await asyncio.gather(*tasks, extra)
        honest.send_signal(signal.SIGTERM)
        honest.wait(timeout=30)
        ctx.term()
        return {"before": before, "reached_s": reached, "settled": settled, "after": after}

    out = asyncio.run(scenario())
    m = scrape(ready["metrics"])
    learner.send_signal(signal.SIGTERM)
    learner.wait(timeout=60)
    before, settled, after = out["before"], out["settled"], out["after"]
    hoarders = {k: v for k, v in after["servers"].items() if k.startswith("hoard-")}
    print({"versions_after": after["version"], "ten_versions_s": round(out["reached_s"], 1),
           "fleet_holds": fleet_holds(settled), "preempted": total(m, "slipstream_leases_preempted_total"),
           "taken": {k: g.get("samples", 0) for k, g in got.items()}})
    assert before["version"] == 0 and before["inflight_samples"] > 0, before
    # It trains on the honest server's work: 10 versions in well under lease_timeout_s (600 s);
    # measured ~25 s (five rotations of trials at silent_min_s; before the shared threshold ~100 s).
    assert settled["version"] >= 10, (settled["version"], lines[-20:])
    assert total(m, "slipstream_leases_preempted_total") > 0, m
    # Then the fleet holds at most the trial budget (one group) and the honest server trains on.
    assert fleet_holds(settled) <= 4, settled["servers"]
    assert after["version"] >= settled["version"] + 10, (settled["version"], after["version"])
    # No hoarder ever holds more than the initial allowance (16), and none has had many turns.
    assert all(v["outstanding"] <= 16 for v in hoarders.values()), hoarders
    assert all(g.get("samples", 0) <= 16 * 3 for g in got.values()), got
    # The 22nd identity is refused, and counted.
    assert "too_many_servers" in got[f"hoard-{FLEET}"].get("errors", []), got[f"hoard-{FLEET}"]
    assert m.get('slipstream_rollout_servers_refused_total{reason="too_many_servers"}', 0) >= 1, m


EXITING_REWARD = '''
import sys


def leave(prompt, completion, metadata):
    sys.exit(3)
'''


def test_a_reward_that_always_fails_stops_the_run_with_one_line(tmp_path, tiny_model_dir,
                                                                 subprocess_env, process_groups):
    cfg = {"model": tiny_model_dir,
           "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                              "total_steps": 50, "batch_prompts": 2, "group_size": 2, "max_new_tokens": 4,
                              "run_dir": str(tmp_path / "run"), "save_every": 0,
                              "servers": {"no_valid_sample_timeout_s": 4.0}}),
           "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 4, "reward": "leaving_reward:leave"}),
           "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}
    start = time.monotonic()
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups, timeout_s=180,
                               plugins={"leaving_reward.py": EXITING_REWARD})
    took = time.monotonic() - start
    reasons = [line for line in out.splitlines() if "stopping: no valid sample" in line]
    print(f"exit {code} after {took:.1f} s; {reasons}")
    assert code == 5, out[-3000:]
    assert len(reasons) == 1, out[-3000:]
    # why, by reason, and the plug-in's last error: "... [reward 1290]; last error: reward leave: SystemExit: 3"
    assert "[reward " in reasons[0] and reasons[0].endswith("reward leave: SystemExit: 3"), reasons
    assert took < 120, took
    # The server was not killed by the plug-in: no restart, no server exit before the stop.
    assert "server_restarted" not in out and "Traceback" not in out, out[-3000:]
    # Shown while it happens, not only at the end: the learner's samples_refused warnings.
    assert "[learner] samples_refused " in out, out[-3000:]


def test_a_refused_sample_releases_its_lease_at_once(tmp_path, tiny_model_dir, subprocess_env,
                                                      process_groups):
    """A group whose reward is beyond max_abs_reward is acked invalid and will not come again:
    its assignment is re-issued now (attempt 2), not after lease_timeout_s (600 s here)."""
    from load_client import group

    learner, ready, lines = start_learner(tmp_path, tiny_model_dir, subprocess_env, process_groups.popen)

    async def scenario() -> tuple[protocol.Assignment, protocol.Assignment, protocol.Ack, float]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ready["rollout"])

        async def recv(kind: type) -> protocol.Message:
            while True:
                assert await sock.poll(10_000), f"no {kind.__name__}"
                msg = protocol.decode(await sock.recv_multipart())
                if isinstance(msg, kind):
                    return msg

        await sock.send_multipart(protocol.encode(protocol.Hello(
            server_id="liar", engine="x", model="none", version=0, max_concurrency=4)))
        await sock.send_multipart(protocol.encode(protocol.WorkRequest(server_id="liar", credits=4)))
        first = await recv(protocol.Assignment)
        samples = group(first, 0)
        for s in samples:
            s.reward = 1e9                              # beyond max_abs_reward (1e6)
        start = time.monotonic()
        await sock.send_multipart(protocol.encode(protocol.RolloutResult(server_id="liar", samples=samples)))
        ack = await recv(protocol.Ack)
        await sock.send_multipart(protocol.encode(protocol.WorkRequest(server_id="liar", credits=4)))
        again = await recv(protocol.Assignment)
        took = time.monotonic() - start
        sock.close(0)
        ctx.term()
        return first, again, ack, took

    first, again, ack, took = asyncio.run(scenario())
    m = scrape(ready["metrics"])
    learner.send_signal(signal.SIGTERM)
    learner.wait(timeout=60)
    assert set(ack.statuses) == {"invalid"}, ack
    assert again.assignment_id == first.assignment_id and again.attempt == first.attempt + 1, (first, again)
    assert took < 10, took
    assert m.get('slipstream_leases_released_total{reason="invalid"}', 0) == 1, m
