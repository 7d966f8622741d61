"""A run across simulated hosts (issue 28 item 5): the learner in one network namespace, rollout
servers in three others, each with its own address on 1 Gbit/s links (tests/integration/
netns_kit.py), CURVE on. It trains while a server joins mid-run and another is SIGKILLed; the
servers fetch every version across the links (as deltas once they hold one), relaying it to each
other (the learner's relay plan), then the learner stops on SIGTERM. The learner binds
every interface and advertises nothing but its loopback: the servers reach its weights socket
at the address they reached the learner at (protocol.plumbing.sockets.reachable_endpoint).

Needs root for ``ip netns``: skipped with its reason otherwise, unless SLIPSTREAM_REQUIRE_NETNS=1
(``.ci/run``), which makes a missing capability a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from config_kit import nested
from netns_kit import Hosts, leftovers, unavailable

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "deploy.cli"]


@pytest.fixture
def netns():
    why = unavailable()
    if why is not None:
        if os.environ.get("SLIPSTREAM_REQUIRE_NETNS") == "1":
            pytest.fail(f"SLIPSTREAM_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
    before = set(leftovers())
    yield
    assert set(leftovers()) <= before, f"namespaces left behind: {sorted(set(leftovers()) - before)}"


def _scrape(host, url: str) -> dict[str, float]:
    """Prometheus samples of ``url`` as seen from inside ``host`` (its loopback)."""
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    out = subprocess.run(host.cmd(sys.executable, "-c", code), capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in out.splitlines())
            if k and not k.startswith("#")}


def _event(line: str) -> dict | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def test_a_run_across_simulated_hosts_trains_with_servers_joining_and_killed(
        netns, tmp_path, tiny_model_dir, subprocess_env, process_groups):
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), *[f"--client=s{i}" for i in (1, 2, 3)]], check=True,
                   env=subprocess_env, capture_output=True, timeout=60)
    learner = nested({"bind_host": "0.0.0.0", "rollout_port": 5555, "weights_port": 5556,
                      "control_port": 5557, "metrics_port": 9400, "total_steps": 100_000,
                      "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4, "max_staleness": 1,
                      "run_dir": str(tmp_path / "run"), "save_every": 0, "threads": 1,
                      "server_timeout_s": 6})
    learner["security"] = {"curve": True, "secret_key_file": str(keys / "learner.key_secret"),
                           "allowed_clients_dir": str(keys / "clients")}
    (tmp_path / "learner.yaml").write_text(yaml.safe_dump({"model": tiny_model_dir, "learner": learner}))

    def rollout_config(i: int) -> str:
        path = tmp_path / f"s{i}.yaml"
        path.write_text(yaml.safe_dump({"model": tiny_model_dir, "rollout": {
            "server_id": f"s{i}", "generation": {"max_concurrency": 8}, "relay": {"port": 5560},
            "security": {"curve": True, "secret_key_file": str(keys / f"s{i}.key_secret"),
                         "learner_public_key_file": str(keys / "learner.key")}}}))
        return str(path)

    with Hosts(4) as hosts:
        home, *others = hosts.hosts
        endpoint = f"tcp://{home.address}:5555"
        try:
            lp = process_groups.watch(home.cmd(*CLI, "learner", "--config", str(tmp_path / "learner.yaml")),
                                      env=subprocess_env, cwd=tmp_path)
            lp.wait_for_event("ready", 120)

            def server(i: int):
                return process_groups.watch(others[i - 1].cmd(*CLI, "rollout", "--config", rollout_config(i),
                                                             "--learner", endpoint),
                                            env=subprocess_env, cwd=tmp_path)

            servers = {1: server(1), 2: server(2)}
            steps: list[dict] = []
            joined: set[str] = set()

            def until(pred, timeout_s: float, what: str):
                def match(line: str):
                    ev = _event(line)
                    if ev is None:
                        return None
                    if ev.get("event") == "step":
                        steps.append(ev)
                    elif ev.get("event") in ("server_joined", "server_rejoined"):
                        joined.add(ev.get("server"))
                    return pred(ev)
                return lp.wait_for(match, timeout_s, what)

            until(lambda ev: joined == {"s1", "s2"}, 300, "s1 and s2 joining")
            until(lambda ev: ev.get("event") == "step" and ev["version"] >= 2, 300, "step 2")
            servers[3] = server(3)                          # joins mid-run
            until(lambda ev: "s3" in joined, 120, "s3 joining")
            os.killpg(servers[2].proc.pid, signal.SIGKILL)  # dies mid-run, holding leases
            until(lambda ev: ev.get("event") == "server_lost" and ev.get("server") == "s2", 60, "s2 lost")
            lost_at = steps[-1]["version"]
            # Training goes on with s1 and s3, s3 on weights it fetched across its link.
            until(lambda ev: ev.get("event") == "step" and ev["version"] >= lost_at + 3
                  and ev["server_versions"].get("s3", 0) > 2, 300, "three more steps with s3")
            served = _scrape(home, "http://127.0.0.1:9400/metrics")
            relayed = _scrape(others[2], "http://127.0.0.1:9401/metrics")
            lp.proc.send_signal(signal.SIGTERM)
            until(lambda ev: ev.get("event") == "stopped", 120, "the learner stopping")
            assert lp.proc.wait(timeout=60) == 0, lp.output(60)
            for i in (1, 3):
                welcome = next(e for e in map(_event, servers[i].lines) if e and e.get("event") == "welcome")
                assert welcome["weights_endpoint"] == f"tcp://{home.address}:5556", welcome
                assert welcome["advertised"] == "tcp://127.0.0.1:5556", welcome
            # Every version after the first went out as deltas to the servers holding the one before.
            assert served['slipstream_weights_chunks_served_total{encoding="delta"}'] > 0, served
            # s3 joined after s1, both relay: the plan has it fetch through s1 (CURVE to s1's key).
            assert relayed['slipstream_weights_received_bytes_total{source="peer"}'] > 0, relayed
            assert relayed['slipstream_weights_relay_failures_total{reason="bad_chunk"}'] == 0, relayed
        finally:
            process_groups.stop_all()
