"""Multi-turn episodes through `slipstream run` (issue 26): the environment docs/agents.md shows,
copied from it into a user's module and loaded as ``module:Class``, trains with nothing changed
in the project; a broken environment fails its episodes, counted, and the run goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from config_kit import nested, rollout_nested
from run_kit import slipstream_run, step_rows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def documented_environment() -> str:
    """The first Python block of docs/agents.md, as a user would copy it."""
    text = (REPO / "docs" / "agents.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def config(tmp_path, model: str, env: dict, steps: int, n_rows: int = 10) -> dict:
    rows = [{"prompt": "guess:", "answer": str(d)} for d in range(n_rows)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    learner = nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                      "total_steps": steps, "batch_prompts": 2, "group_size": 2, "max_new_tokens": 3,
                      "run_dir": str(tmp_path / "run"), "save_every": 0,
                      "data": {"dataset": str(tmp_path / "train.jsonl")}})
    learner.setdefault("sampling", {}).update(max_turns=3, max_episode_tokens=24)
    return {"model": model, "learner": learner,
            "rollout": {**rollout_nested({"metrics_port": 0, "max_concurrency": 8}), "environment": env},
            "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}


def test_the_documented_environment_trains_through_slipstream_run(tmp_path, tiny_model_dir, subprocess_env,
                                                                  process_groups):
    cfg = config(tmp_path, tiny_model_dir, {"class_name": "my_env:GuessNumber", "options": {"turn_cost": 0.1}},
                 steps=3)
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups,
                               plugins={"my_env.py": documented_environment()})
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    assert len(rows) == 3, rows
    for r in rows:
        # Episodes: 1-3 turns each, the environment's tokens outside the model's, rewards from
        # the environment alone (solved 1, -0.1 a missed guess).
        assert 1 <= r["episode_turns_mean"] <= 3, r
        assert r["episode_model_tokens_mean"] < r["completion_tokens_mean"] or r["episode_turns_mean"] == 1, r
        assert -0.3 - 1e-6 <= r["reward_mean"] <= 1.0, r
        assert r["policy_updated"] == 1.0
    assert any(r["episode_turns_mean"] > 1 for r in rows), rows


BROKEN = '''
from pathlib import Path


class Broken:
    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        if state.metadata["answer"] in "02468":
            Path("broke").touch()                      # the test's witness that it did
            raise RuntimeError("the game server is down")
        return None, 1.0, True, {}
'''


def test_an_environment_that_raises_fails_its_episodes_and_the_run_goes_on(tmp_path, tiny_model_dir,
                                                                          subprocess_env, process_groups):
    cfg = config(tmp_path, tiny_model_dir, {"class_name": "broken_env:Broken"}, steps=2)
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups, plugins={"broken_env.py": BROKEN})
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    # Half the prompts fail their episodes: none of those groups is trained (each would bring
    # rewards of 0), the others are.
    assert (tmp_path / "broke").exists()
    assert len(rows) == 2 and all(r["reward_mean"] == 1.0 for r in rows), rows


def test_a_server_killed_mid_episode_has_its_episodes_reissued_whole(tmp_path, tiny_model_dir, subprocess_env,
                                                                    process_groups):
    """Two servers; an episode of one is held in its environment's step and that server is
    SIGKILLed there. Its lease is re-issued and the group runs again, whole, elsewhere (or on the
    restarted server): the run ends, nothing is trained twice, the buffer's identities hold."""
    import os
    import signal

    from chaos_kit import ChaosRun, chaos_env, check_run
    from chaos_kit import config as chaos_config

    steps = 6
    cfg = chaos_config(tmp_path / "run", tiny_model_dir, total_steps=steps, servers=2)
    cfg["learner"].setdefault("sampling", {}).update(max_new_tokens=3, max_turns=2, max_episode_tokens=16)
    cfg["rollout"]["environment"] = "chaos_envs:HeldOnce"
    hold = tmp_path / "hold"
    hold.touch()
    env = dict(chaos_env(subprocess_env, tmp_path), SLIPSTREAM_TEST_HOLD=str(hold))
    run = ChaosRun(cfg, tmp_path, env, popen=process_groups.popen)
    try:
        run.wait(lambda: any(tmp_path.glob("held.*")), 240, "an episode held in its step")
        pid = int(next(tmp_path.glob("held.*")).suffix[1:])
        name = next(n for n, p in run.pids.items() if p == pid)
        os.kill(pid, signal.SIGKILL)
        run.kills.append((__import__("time").time(), name, pid))
        run.kills_left_serving.append(1)
        hold.unlink()
        code = run.finish(300)
        assert code == 0, "".join(run.lines[-60:])
        figures = check_run(run, steps, batch_samples=4)
    finally:
        run.stop()
    assert figures["kills"] == 1
    rows = step_rows(tmp_path / "run")
    assert all(r["episode_turns_mean"] == 2 for r in rows), rows


@pytest.mark.parametrize("algorithm", ["gae", "rloo"])
def test_ppo_with_a_critic_and_rloo_train_on_episodes(algorithm, tmp_path, tiny_model_dir, subprocess_env,
                                                      process_groups):
    """The learner's other estimators on episodes (issue 26 item 5): GAE with a critic (the
    environment's tokens are holes its recursion skips: the value after a turn is the one at the
    next turn's first token) and RLOO's leave-one-out groups over the episodes of a prompt."""
    learner = nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                      "total_steps": 3, "batch_prompts": 2, "group_size": 4, "run_dir": str(tmp_path / "run"),
                      "save_every": 0, "data": {"dataset": "builtin:guess"}})
    learner.setdefault("sampling", {}).update(max_new_tokens=3, max_turns=3, max_episode_tokens=24)
    if algorithm == "gae":
        learner["algorithm"] = {"advantage": "gae", "gamma": 1.0, "lam": 0.95}
        learner["critic"] = {"model": None, "lr": 1e-3, "warmup_steps": 1}
    else:
        learner["algorithm"] = {"advantage": "rloo"}
    cfg = {"model": tiny_model_dir, "learner": learner,
           "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 8}),
           "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups)
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    assert len(rows) == 3 and all(1 <= r["episode_turns_mean"] <= 3 for r in rows), rows
    if algorithm == "gae":
        assert all("vf_loss" in r for r in rows) and rows[-1]["policy_updated"] == 1.0, rows
    else:
        assert all(r["policy_updated"] == 1.0 for r in rows), rows


EVERY_WAY_TO_FAIL = '''
import asyncio
import math
from pathlib import Path


class EveryWayToFail:
    """The row's digit picks how the environment misbehaves; only 9 plays fair."""

    async def reset(self, prompt, metadata):
        self.kind = int(metadata["answer"])
        return None

    async def step(self, completion, state):
        Path(f"did-{self.kind}").touch()
        if self.kind in (0, 1):
            raise RuntimeError("the sandbox crashed")
        if self.kind in (2, 3):
            await asyncio.sleep(30)                       # past step_timeout_s
        if self.kind in (4, 5):
            return "x" * 500, 0.0, False, {}              # past max_observation_tokens
        if self.kind in (6, 7):
            return None, {"score": math.nan}, True, {}
        if self.kind == 8:
            return {"content": 42}, 0.0, False, {}        # not text
        return None, 1.0, True, {}
'''


def test_every_bad_environment_fails_only_its_episodes_in_a_real_run(tmp_path, tiny_model_dir, subprocess_env,
                                                                     process_groups):
    """Issue 26 item 7 through real processes: an environment that raises, hangs, returns a huge
    observation, a NaN reward or an observation that is not text ends those episodes only; the
    server keeps serving and the run trains on the fair ones alone."""
    cfg = config(tmp_path, tiny_model_dir, {"class_name": "bad_envs:EveryWayToFail", "step_timeout_s": 0.5,
                                            "max_observation_tokens": 50}, steps=2)
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups,
                               plugins={"bad_envs.py": EVERY_WAY_TO_FAIL})
    assert code == 0, out[-3000:]
    assert {p.name for p in tmp_path.glob("did-*")} >= {f"did-{k}" for k in (0, 2, 4, 6, 8, 9)}
    rows = step_rows(tmp_path / "run")
    assert len(rows) == 2 and all(r["reward_mean"] == 1.0 for r in rows), rows


FAILS_FIRST = '''
from pathlib import Path


class FailsTheFirstTime:
    """Each prompt's first episode to reach its step crashes; after that the prompt plays fair."""

    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        seen = Path(f"seen-{state.metadata['answer']}")
        if not seen.exists():
            seen.touch()
            raise RuntimeError("a flaky sandbox")
        return None, 1.0, True, {}
'''


def test_on_failure_reissue_runs_a_failed_group_again_through_a_real_run(tmp_path, tiny_model_dir,
                                                                         subprocess_env, process_groups):
    """rollout.environment.on_failure: reissue: every prompt's first group fails (its first
    episode crashes), goes back to the learner and is issued again; the second try is fair. With
    40 prompts, on_failure: fail would drop the first group of each and see all 40 before it
    trained one (``seen-*``); re-issued, the 4 prompts the run trains (and the few issued ahead)
    are all it sees."""
    cfg = config(tmp_path, tiny_model_dir, {"class_name": "flaky_env:FailsTheFirstTime",
                                            "on_failure": "reissue"}, steps=2, n_rows=40)
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups,
                               plugins={"flaky_env.py": FAILS_FIRST})
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    assert len(rows) == 2 and all(r["reward_mean"] == 1.0 for r in rows), rows
    seen = len(list(tmp_path.glob("seen-*")))
    assert 4 <= seen <= 16, seen


ALWAYS_FAILS = '''
class CrashesAfterOneTurn:
    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        if state.turn == 0:
            return " again:", 0.0, False, {}
        raise RuntimeError("the sandbox crashed")
'''


def test_on_failure_train_trains_failed_episodes_at_the_failure_reward(tmp_path, tiny_model_dir,
                                                                       subprocess_env, process_groups):
    """rollout.environment.on_failure: train: every episode fails on its second step; the run
    still trains, each episode's two turns at failure_reward (under fail it would stall)."""
    cfg = config(tmp_path, tiny_model_dir, {"class_name": "crashing_env:CrashesAfterOneTurn",
                                            "on_failure": "train", "failure_reward": -1.0}, steps=2)
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups,
                               plugins={"crashing_env.py": ALWAYS_FAILS})
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    assert len(rows) == 2, rows
    assert all(r["reward_mean"] == -1.0 and r["episode_turns_mean"] == 2 for r in rows), rows
