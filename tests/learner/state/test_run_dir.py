"""A run directory belongs to one run (issue 30.2; learner.state.run_dir)."""

from __future__ import annotations

import json

import pytest

from learner.state.run_dir import RUN_FILE, check_free, claim, owner
from protocol.errors import StartupError


def test_a_fresh_directory_and_a_failed_start_are_free(tmp_path):
    check_free(tmp_path / "new")
    (tmp_path / "config.yaml").write_text("learner: {}\n")     # what a start that failed leaves
    (tmp_path / "checkpoints" / ".tmp-step-3-x").mkdir(parents=True)   # and a torn checkpoint
    check_free(tmp_path)
    claim(tmp_path, "run-a", resumed=False)
    assert json.loads((tmp_path / RUN_FILE).read_text()) == {"run_id": "run-a"}


@pytest.mark.parametrize("left", ["run.json", "metrics", "checkpoint", "final"])
def test_a_new_run_in_a_used_directory_is_one_line(tmp_path, left):
    if left == "run.json":
        (tmp_path / RUN_FILE).write_text('{"run_id": "run-a"}')
    elif left == "metrics":                         # a run from before run.json
        (tmp_path / "metrics.jsonl").write_text('{"run_id": "run-a", "step": 1}\n')
    elif left == "checkpoint":
        (tmp_path / "checkpoints" / "step-4").mkdir(parents=True)
        (tmp_path / "checkpoints" / "step-4" / "COMPLETE").write_text("{}")
    else:
        (tmp_path / "final").mkdir()
    for attempt in (lambda: check_free(tmp_path), lambda: claim(tmp_path, "run-b", resumed=False)):
        with pytest.raises(StartupError, match="learner.run_dir .* holds .*add --resume") as e:
            attempt()
        assert "\n" not in str(e.value)
    assert ("run-a" in str(e.value)) == (left in ("run.json", "metrics"))


def test_resume_continues_the_directorys_own_run_only(tmp_path):
    claim(tmp_path, "run-a", resumed=False)
    claim(tmp_path, "run-a", resumed=True)                  # its own checkpoint: fine
    with pytest.raises(StartupError, match="holds run run-a, and the checkpoint to resume is of run run-b"):
        claim(tmp_path, "run-b", resumed=True)
    assert owner(tmp_path) == "run-a"


def test_a_resume_into_a_directory_without_run_json_claims_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"run_id": "run-a", "step": 1}\n')
    claim(tmp_path, "run-a", resumed=True)
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == "run-a"
