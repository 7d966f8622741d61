"""Startup errors: one line on stderr saying what to fix, exit code 2, no traceback, and found
before the model loads where they can be. Runtime errors are never called config errors."""

from __future__ import annotations

import queue
import socket
import sys

import pytest
import yaml
from config_kit import nested, rollout_nested

from deploy import launcher
from deploy.cli import main

CLI = [sys.executable, "-m", "deploy.cli"]
NO_MODEL = "/nonexistent/model-dir"      # reaching the model would fail differently


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _config(tmp_path, **sections) -> str:
    f = tmp_path / "c.yaml"
    if "learner" in sections:            # flat names for short (config_kit.nested)
        sections["learner"] = nested(sections["learner"])
    if "rollout" in sections:
        sections["rollout"] = rollout_nested(sections["rollout"])
    f.write_text(yaml.safe_dump(sections))
    return str(f)


@pytest.fixture
def taken_port():
    """A port with a listening socket on it (binding it again fails with EADDRINUSE)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_learner_endpoint_without_scheme_fails_before_the_model_loads(tmp_path, capsys):
    cfg = _config(tmp_path, model=NO_MODEL)
    assert main(["rollout", "--config", cfg, "--learner", "localhost:5555"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--learner" in line and "tcp://" in line and "model" not in line


def test_learner_endpoint_in_the_config_is_checked_too(tmp_path, capsys):
    cfg = _config(tmp_path, model=NO_MODEL, rollout={"learner": "tcp://127.0.0.1"})
    assert main(["rollout", "--config", cfg]) == 2
    assert "rollout.learner" in _one_line(capsys.readouterr().err)


def test_missing_dataset_under_run_fails_before_any_process(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", "--set", f"model={NO_MODEL}", "--set", f"learner.run_dir={run_dir}",
                 "--set", f"learner.data.dataset={tmp_path / 'nope.jsonl'}"]) == 2
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert "learner.data.dataset" in line and "nope.jsonl" in line and "no such file" in line
    assert "pid" not in captured.out and not run_dir.exists()      # nothing was started


def test_dataset_line_that_is_not_json_names_the_file_and_line(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4\n')
    cfg = _config(tmp_path, model=NO_MODEL, learner={"dataset": str(data)})
    assert main(["learner", "--config", cfg]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{data}:3: not JSON" in line


def test_ctl_without_a_learner_file_says_what_to_pass(tmp_path, capsys):
    assert main(["ctl", "--run-dir", str(tmp_path), "status"]) == 2
    assert "--endpoint" in _one_line(capsys.readouterr().err)


def test_a_runtime_error_is_not_reported_as_a_config_error(tmp_path, monkeypatch, tiny_model_dir, capsys):
    import learner.serve.service

    def serve(cfg, model_path, **options):
        raise ValueError("a bug in the training loop")

    monkeypatch.setattr(learner.serve.service, "serve", serve)
    cfg = _config(tmp_path, model=tiny_model_dir, learner={"run_dir": str(tmp_path / "run")})
    with pytest.raises(ValueError, match="a bug in the training loop"):
        main(["learner", "--config", cfg])
    assert "config error" not in capsys.readouterr().err


@pytest.mark.parametrize("key", ["rollout_port", "metrics_port"])
def test_learner_port_in_use_is_one_line(tmp_path, tiny_model_dir, subprocess_env, process_groups,
                                         taken_port, key):
    ports = {"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
             key: taken_port}
    cfg = _config(tmp_path, model=tiny_model_dir, learner={**ports, "run_dir": str(tmp_path / "run")})
    r = process_groups.run([*CLI, "learner", "--config", cfg], timeout=180, env=subprocess_env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    line = _one_line(r.stderr)
    assert str(taken_port) in line and "in use" in line


def test_run_forwards_the_learners_one_line_error(tmp_path, tiny_model_dir, subprocess_env,
                                                  process_groups, taken_port):
    """The launcher cannot check a port in advance without racing: the learner's own one-line
    error reaches the user, not just "learner exited with code 2"."""
    r = process_groups.run(
        [*CLI, "run", "--set", f"model={tiny_model_dir}", "--set", f"learner.run_dir={tmp_path / 'run'}",
         "--set", f"learner.network.rollout_port={taken_port}", "--set", "learner.network.weights_port=0",
         "--set", "learner.network.control_port=0", "--set", "learner.network.metrics_port=0"],
        timeout=180, env=subprocess_env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    forwarded = [x for x in r.stdout.splitlines() if x.startswith("[learner] slipstream:")]
    assert len(forwarded) == 1 and str(taken_port) in forwarded[0], r.stdout
    assert "[run] learner exited with code 2" in r.stdout
    assert "Traceback" not in r.stdout


def _drain(child: launcher.Child, events: queue.Queue, verbose: bool = False) -> int:
    """Run the launcher's handling of one child's output until it exits; its exit code."""
    while True:
        name, kind, line = events.get(timeout=60)
        assert name == child.name
        if kind == "err":
            launcher._on_stderr(child, line, verbose)
        elif kind == "exit":
            code = child.proc.wait()
            launcher._report_exit(child, code)
            return code


def test_launcher_shows_a_childs_error_line_and_a_crash_traceback(capsys):
    events: queue.Queue = queue.Queue()
    env = {"PATH": "/usr/bin:/bin"}
    startup = launcher.Child("learner", [sys.executable, "-c",
                                         "import sys; print('noise', file=sys.stderr); "
                                         "print('slipstream: fix this', file=sys.stderr); sys.exit(2)"],
                             events, env)
    assert _drain(startup, events) == 2
    out = capsys.readouterr().out.splitlines()
    assert out == ["[learner] slipstream: fix this", "[run] learner exited with code 2"]

    crash = launcher.Child("rollout-0", [sys.executable, "-c", "raise RuntimeError('boom')"], events, env)
    assert _drain(crash, events) == 1
    out = capsys.readouterr().out
    assert "[run] rollout-0 exited with code 1" in out
    assert "[rollout-0] Traceback (most recent call last):" in out
    assert "[rollout-0] RuntimeError: boom" in out


def test_unknown_reward_is_one_line(tmp_path, tiny_model_dir, capsys):
    cfg = _config(tmp_path, model=tiny_model_dir, rollout={"reward": "builtin:nope", "metrics_port": 0})
    assert main(["rollout", "--config", cfg, "--learner", "tcp://127.0.0.1:1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "rollout.reward" in line and "builtin:nope" in line


def test_launcher_gives_a_server_a_free_metrics_port_when_the_default_is_taken(taken_port, capsys):
    from deploy.config_file import load_config

    cfg = load_config(None, [])
    cfg.rollout.network.__dict__["metrics_port"] = taken_port  # as the default, not set by the user
    assert "metrics_port" not in cfg.rollout.network.model_fields_set
    assert launcher._server_metrics_port(cfg, 0) == 0
    assert f"metrics port {taken_port} is in use" in capsys.readouterr().out
    assert launcher._server_metrics_port(cfg, 1) == taken_port + 1 or not launcher._port_free(
        "127.0.0.1", taken_port + 1)
    chosen = load_config(None, [f"rollout.network.metrics_port={taken_port}"])
    assert launcher._server_metrics_port(chosen, 0) == taken_port     # the user's choice stands


# ---- issue 31.8: what used to be a traceback (exit 1) ---------------------------------------------

@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    if where == "under_a_file":
        (tmp_path / "file").write_text("x")
        run_dir, why = tmp_path / "file" / "run", "not a directory"
    else:                                        # root passes permission bits; /proc refuses anyway
        run_dir, why = "/proc/slipstream-run", "cannot be created"
    cfg = _config(tmp_path, model=NO_MODEL, learner={"run_dir": str(run_dir)})
    assert main(["learner", "--config", cfg]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "learner.run_dir" in line and why in line, line


@pytest.mark.parametrize("content, why", [("", "is empty"), ("{not json", "is not JSON"),
                                          ("[1, 2]", "not an object")])
def test_a_model_dir_whose_config_json_is_broken_is_one_line(tmp_path, capsys, content, why):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(content)
    cfg = _config(tmp_path, model=str(model), learner={"run_dir": str(tmp_path / "run")})
    assert main(["learner", "--config", cfg]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "config.json" in line and why in line, line


def test_an_unreadable_rollout_log_segment_is_one_line(tmp_path):
    from learner.state.rollout_log import LogReader
    from protocol.errors import StartupError

    (tmp_path / "life-0001-000001.log").mkdir()       # a segment's name, not readable as a file
    with pytest.raises(StartupError, match="rollout log segment .*life-0001-000001.log cannot be read"):
        list(LogReader(tmp_path))


def test_ctl_set_with_an_integer_the_protocol_cannot_carry_exits_2(capsys):
    # checked before connecting: nothing listens on this endpoint, and the answer is still 2
    code = main(["ctl", "--endpoint", "tcp://127.0.0.1:9", "--timeout-s", "1", "set", "total_steps",
                 str(1 << 70)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "out of range" in line and str(1 << 70) in line, line


def test_keys_prints_absolute_paths(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["keys", "keys-dir", "--client", "srv", "--operator", "ops"]) == 0
    out = capsys.readouterr().out
    paths = [w for w in out.replace(":", " ").split() if "keys-dir" in w]
    assert paths and all(p.startswith("/") for p in paths), out


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_non_finite_float_setting_is_one_line(tmp_path, capsys, value):
    """issue 31.1: `learner.optimizer.lr: .inf` used to start, and the first step broke the model."""
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {NO_MODEL}\nlearner:\n  optimizer:\n    lr: {value}\n")
    assert main(["learner", "--config", str(f)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "learner.optimizer.lr" in line and "finite" in line, line


@pytest.mark.parametrize("algorithm,says", [
    ({"policy_loss": "gspo", "dual_clip": 3.0}, "dual_clip"),
    ({"policy_loss": "cispo", "dual_clip": 3.0}, "dual_clip"),
    ({"policy_loss": "gspo", "clip_anchor": "behavior"}, "clip_anchor"),
    ({"policy_loss": "grpo"}, "policy_loss"),
    ({"is_mode": "icepop", "icepop_low": 1.5}, "icepop_low"),
    ({"loss_agg": "seq_mean_token_sum_norm", "loss_norm_tokens": 0}, "loss_norm_tokens"),
])
def test_a_refused_policy_loss_combination_is_one_line(tmp_path, capsys, algorithm, says):
    """issue 27.2: a combination that makes no sense is refused before anything starts."""
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": NO_MODEL, "learner": {"algorithm": algorithm}}))
    assert main(["learner", "--config", str(f)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert says in line, line
