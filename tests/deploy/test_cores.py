"""How `slipstream run` shares cores: the rule of deploy/cores.py, case by case."""

from __future__ import annotations

import os

import pytest

from deploy.cores import available_cores, quota_cores, share_cores


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
