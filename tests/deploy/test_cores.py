"""How `slipstream run` shares cores: the rule of deploy/cores.py, case by case."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.cores import allowed_cpus, available_cores, pin, plan_affinity, quota_cores, share_cores


@pytest.mark.parametrize("cores, servers, expected", [
    (2, 1, (1, 1)),        # measured on 2 cores: 773-824 samples/s against 560 with defaults
    (1, 1, (1, 1)),        # fewer cores than processes: everyone still gets one thread
    (2, 3, (1, 1)),
    (3, 1, (2, 1)),        # 3 // 2 = 1 each, the remainder (1) to the learner
    (8, 1, (4, 4)),
    (8, 3, (2, 2)),
    (16, 3, (4, 4)),
    (10, 3, (4, 2)),       # 10 // 4 = 2 each, remainder 2 to the learner: 4 + 3 * 2 = 10
])
def test_split_when_nothing_is_set(cores, servers, expected):
    learner, each = share_cores(cores, servers)
    assert (learner, each) == expected
    assert learner + servers * each <= max(cores, servers + 1)     # never more threads than needed


@pytest.mark.parametrize("cores, servers, learner_threads, rollout_threads, expected", [
    (8, 2, 4, 0, (4, 2)),      # learner kept; (8 - 4) // 2 = 2 per server
    (8, 2, 8, 0, (8, 1)),      # the learner took every core: servers still get one
    (8, 3, 0, 2, (2, 2)),      # servers kept; the learner gets 8 - 3 * 2 = 2
    (4, 4, 0, 1, (1, 1)),      # servers use every core: the learner still gets one
    (2, 1, 3, 5, (3, 5)),      # both set: both kept, even oversubscribed
])
def test_a_setting_in_the_config_is_kept(cores, servers, learner_threads, rollout_threads, expected):
    assert share_cores(cores, servers, learner_threads, rollout_threads) == expected


@pytest.mark.parametrize("cores, servers, learner_threads, rollout_threads, expected", [
    (2, 1, 0, 0, (2, 1)),      # eta 0: the learner trains while the server waits, and back
    (8, 3, 0, 0, (8, 2)),      # the servers keep their share
    (8, 2, 0, 3, (8, 3)),
    (8, 2, 4, 0, (4, 2)),      # a learner setting is kept
    (2, 1, 1, 1, (1, 1)),
])
def test_a_synchronous_run_gives_the_learner_every_core(cores, servers, learner_threads,
                                                         rollout_threads, expected):
    assert share_cores(cores, servers, learner_threads, rollout_threads, synchronous=True) == expected
    if not (learner_threads or rollout_threads):
        assert share_cores(cores, servers)[1] == expected[1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        share_cores(0, 1)
    with pytest.raises(ValueError):
        share_cores(4, 0)


@pytest.mark.parametrize("text, expected", [
    ("200000 100000\n", 2), ("150000 100000", 2), ("50000 100000", 1), ("max 100000", None),
    ("", None), ("garbage", None), ("0 100000", None),
])
def test_cgroup_quota(text, expected):
    assert quota_cores(text) == expected


def test_available_cores_is_capped_by_the_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path / "missing") == affinity
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert available_cores(tmp_path / "cpu.max") == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 4) * 100000} 100000\n")
    assert available_cores(tmp_path / "cpu.max") == affinity


@pytest.mark.parametrize("cpus, servers, learner_threads, rollout_threads, cores, expected", [
    ([0, 1], 1, 1, 1, 2, {"learner": [0], "rollout-0": [1]}),       # the demo at eta > 0 on 2 cores
    ([0, 1, 2, 3, 4, 5, 6, 7], 3, 2, 2, 8,
     {"learner": [0, 1], "rollout-0": [2, 3], "rollout-1": [4, 5], "rollout-2": [6, 7]}),
    ([2, 5, 7], 1, 2, 1, 3, {"learner": [2, 5], "rollout-0": [7]}),  # the CPUs allowed, in order
    ([0, 1], 1, 2, 1, 2, None),          # eta 0: the learner on every core, oversubscribed
    ([0, 1], 2, 1, 1, 2, None),          # more processes than cores
    ([0, 1, 2, 3], 1, 1, 1, 4, None),    # cores left over: the OS places
    ([0, 1, 2, 3], 1, 1, 1, 2, None),    # a CPU quota of 2 over 4 CPUs: cores are time, not CPUs
    ([], 1, 1, 1, 2, None),              # no affinity on this OS
])
def test_affinity_plan(cpus, servers, learner_threads, rollout_threads, cores, expected):
    assert plan_affinity(cpus, servers, learner_threads, rollout_threads, cores) == expected


def test_pin_sets_a_real_child_and_the_threads_it_starts(tmp_path):
    """The launcher's pin on a real child, from outside, right after it starts: the child's
    own affinity and that of a thread it starts afterwards are the one CPU given."""
    cpu = allowed_cpus()[-1]
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, threading\n"
        "sys.stdin.readline()\n"                                    # until the parent has pinned
        "t = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0)), flush=True))\n"
        "t.start(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), flush=True)\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert pin(child.pid, [cpu])
        assert os.sched_getaffinity(child.pid) == {cpu}
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
        child.wait()
    assert out.split("\n")[:2] == [f"[{cpu}]", f"[{cpu}]"]
    assert not pin(child.pid, [cpu])                        # gone: refused, nothing raised


def test_the_launcher_pins_only_where_the_split_fits(monkeypatch, capsys):
    from deploy import launcher
    from deploy.config_file import SlipstreamConfig

    monkeypatch.setattr(launcher, "available_cores", lambda: 2)
    monkeypatch.setattr(launcher, "allowed_cpus", lambda: [0, 1])
    cfg = SlipstreamConfig()                                    # the demo: eta 1, one server
    assert launcher._thread_split(cfg) == (1, 1, {"learner": [0], "rollout-0": [1]})
    assert "[run] cores: learner 0, rollout-0 1" in capsys.readouterr().out
    cfg.launcher.pin_cores = False
    assert launcher._thread_split(cfg) == (1, 1, {})
    cfg.launcher.pin_cores = True
    cfg.learner.staleness.max_staleness = 0                               # the learner takes both cores
    assert launcher._thread_split(cfg) == (2, 1, {})
    assert "[run] cores" not in capsys.readouterr().out
