"""Append-only records and checkpoint markers that a crash, a kill or a full disk leaves damaged
(issue 31, items 5 and 8): every JSONL record is written whole or not at all — on a real full
filesystem (a small tmpfs) too —, a torn last line is cut off at open and skipped on read, a bad line
in the middle is one line naming it, a full disk under StepRecords is an event (never an error),
and ``--resume`` treats a garbage COMPLETE marker and a damaged file alike: it falls back to the
newest checkpoint that verifies, with a warning for each one passed over."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from disk_kit import fill, small_disk

from buffer import Batch
from learner.metrics import JsonlLog, LearnerMetrics
from learner.serve.step_records import StepRecords
from learner.state.checkpoint import Checkpointer, effective_trained_ids
from learner.state.learner_checkpoints import LearnerCheckpoints
from protocol import Sample
from protocol.errors import StartupError


def batch(n: int = 4, tag: str = "a") -> Batch:
    samples = [Sample(sample_id=f"{tag}/{i}", assignment_id=tag, group_index=i, group_size=n,
                      prompt_token_ids=np.array([1, 5], np.int32),
                      completion_token_ids=np.array([6], np.int32),
                      behavior_logprobs=np.array([-1.0], np.float32),
                      token_versions=np.array([0], np.int32), reward=0.0) for i in range(n)]
    return Batch(samples, version=0, staleness=[0] * n, needs_correction=[False] * n, group_sizes=[n])


# ---- JsonlLog: whole records, torn tails ---------------------------------------------------------

@pytest.mark.parametrize("content, torn, kept", [
    (b'{"a": 1}\n{"b": [1, 2', b'{"b": [1, 2', 1),          # a write cut short
    (b'{"a": 1}\n\0\0\0\0', b"\0\0\0\0", 1),                 # zeros after a power loss
    (b'{"a": 1}\n{"b": 2}', b"", 2),                          # a whole object short of its newline
    (b'{"b": ', b'{"b": ', 0),
    (b"", b"", 0),
])
def test_a_torn_last_line_is_cut_off_at_open_and_never_merged(tmp_path, content, torn, kept):
    path = tmp_path / "trained_ids.jsonl"
    path.write_bytes(content)
    log = JsonlLog(path)
    assert log.torn == torn
    log.write({"next": 1})
    log.close()
    records, tail = JsonlLog.read(path)
    assert tail == b"" and len(records) == kept + 1 and records[-1] == {"next": 1}
    assert path.read_bytes().endswith(b'{"next": 1}\n')


def test_a_torn_last_line_is_skipped_on_read_and_a_bad_middle_line_is_named(tmp_path):
    path = tmp_path / "trained_ids.jsonl"
    lines = [{"run_id": "r", "trained_on_version": 0, "sample_ids": ["a/0", "a/1"]},
             {"run_id": "r", "trained_on_version": 1, "sample_ids": ["b/0"]}]
    whole = "".join(json.dumps(x) + "\n" for x in lines)
    path.write_text(whole + '{"run_id": "r", "trained_on_version": 2, "sample_i')
    events = []
    assert effective_trained_ids(path, log=lambda e, **f: events.append((e, f))) == ["a/0", "a/1", "b/0"]
    assert [e for e, _ in events] == ["record_torn"] and events[0][1]["level"] == "warning"
    assert effective_trained_ids(path) == ["a/0", "a/1", "b/0"]     # (no log: skipped all the same)
    # Merged by a writer before this fix: a torn line with the next record after it.
    path.write_text(json.dumps(lines[0]) + "\n" + '{"run_id": "r", "trained_on' + whole)
    with pytest.raises(StartupError, match=r"line 2 of 3 is not a JSON object") as err:
        effective_trained_ids(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_full_disk_leaves_no_torn_line_and_writing_resumes_when_freed():
    with small_disk("1m") as disk:
        filler = fill(disk)
        os.truncate(filler, filler.stat().st_size - (200 << 10))   # 200 KiB left for the rows
        path = disk / "metrics.jsonl"
        log = JsonlLog(path)
        row = {"step": 0, "pad": "x" * 3000}
        written = 0
        with pytest.raises(OSError) as err:
            while True:                       # ~3 KiB rows: the last one fits only in part
                log.write({**row, "step": written})
                written += 1
        assert err.value.errno == errno.ENOSPC and written > 30
        assert path.stat().st_size == log.size                   # cut back to the last whole row
        records, tail = JsonlLog.read(path)
        assert tail == b"" and [r["step"] for r in records] == list(range(written))
        with pytest.raises(OSError):         # short rows fail too, once the last page is used
            for _ in range(10_000):
                log.write({"step": written})
                written += 1
        assert path.stat().st_size == log.size
        filler.unlink()                       # freed: the next row goes on after the last whole one
        log.write({"step": written})
        log.close()
        records, tail = JsonlLog.read(path)
        assert tail == b"" and [r["step"] for r in records][-1] == written
        assert [r["step"] for r in records] == list(range(written + 1))


# ---- StepRecords: a full disk is an event ----------------------------------------------------------

def _records(events: list, on_write_failure=None) -> StepRecords:
    return StepRecords(run=SimpleNamespace(run_id="r", version=3), metrics=LearnerMetrics(),
                       log=lambda e, **f: events.append((e, f)), buffer=None, admission=None,
                       algorithm=SimpleNamespace(sanity_ratio_tolerance=1.0, sanity_kl_tolerance=1.0),
                       clock=lambda: 0.0, on_write_failure=on_write_failure)


def test_step_records_on_a_full_disk_are_an_event_then_a_recovery():
    BIG = 600                                 # samples a step: a line past a page (tmpfs slack)
    with small_disk("256k") as disk:
        (disk / "trained_ids.jsonl").write_bytes(b'{"run_id": "r", "trained_on_version": 0, "sampl')
        events: list = []
        rec = _records(events)
        rec.open(disk, [])
        assert [e for e, _ in events] == ["record_torn"]           # the earlier life's torn tail
        rec.trained(batch(BIG, tag="a"))
        filler = fill(disk)
        for tag in "bcd":                   # three steps on a full disk: one event, no error
            rec.trained(batch(BIG, tag=tag))
            rec.eval_round({"eval_version": 3, "pad": "x" * 5000})
        failed = [f for e, f in events if e == "record_failed"]
        assert [Path(f["file"]).name for f in failed] == ["trained_ids.jsonl", "metrics.jsonl"]
        assert failed[0]["errno"] == "ENOSPC" and failed[0]["level"] == "error"
        assert "training goes on" in failed[0]["action"]
        filler.unlink()
        rec.trained(batch(BIG, tag="e"))
        rec.close()
        assert ("record_recovered", {"file": str(disk / "trained_ids.jsonl"), "lost": 3}) in events
        assert effective_trained_ids(disk / "trained_ids.jsonl") == [f"{t}/{i}" for t in "ae" for i in range(BIG)]
        assert JsonlLog.read(disk / "metrics.jsonl") == ([], b"")


def test_a_record_failure_under_checkpoint_failure_stop_stops_cleanly(tmp_path):
    """The hook the service passes (LearnerCheckpoints.write_failed): the checkpoint rule."""
    def checkpoints(failure: str) -> LearnerCheckpoints:
        settings = SimpleNamespace(dir=None, keep_last=2, failure=failure, save_every=0)
        return LearnerCheckpoints(settings, tmp_path, run=None, metrics=LearnerMetrics(),
                                  log=lambda *a, **k: None, stopping=asyncio.Event())
    go_on = checkpoints("continue")
    assert "goes on" in go_on.write_failed(OSError(errno.ENOSPC, "No space left on device"))
    assert not go_on.stopping.is_set() and not go_on.failed_stop
    stop = checkpoints("stop")
    events: list = []
    rec = _records(events, on_write_failure=stop.write_failed)
    rec.open(tmp_path, [])
    rec.trained_ids.file.close()              # a write that fails (an OSError) as a full disk's would
    rec.trained_ids.file = open(tmp_path / "trained_ids.jsonl", "rb", buffering=0)
    rec.trained(batch())
    assert stop.stopping.is_set() and stop.failed_stop
    assert [f["action"] for e, f in events if e == "record_failed"] == ["stopping (checkpoint_failure: stop)"]
    rec.close()


# ---- checkpoints: one rule for a garbage marker and a damaged file --------------------------------

@pytest.fixture(scope="module")
def three(tmp_path_factory, tiny_model_dir):
    """Complete checkpoints step-1..3 of a tiny trainer (the tests copy them)."""
    from config_kit import nested

    from learner.config import LearnerConfig, TrainerConfig
    from learner.train.trainer import Trainer

    cfg = LearnerConfig(**nested(group_size=4, batch_prompts=1, micro_batch_samples=4, threads=1,
                                 total_steps=10))
    tr = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    root = tmp_path_factory.mktemp("three") / "ck"
    store = Checkpointer(root)
    for v in (1, 2, 3):
        store.save(v, {"run_id": "r", "assignment_counter": v, "data": {"position": v}, "buffer": {}}, tr)
    return root


def _resume(root: Path, spec=None):
    events: list = []
    settings = SimpleNamespace(dir=root, keep_last=5, failure="continue", save_every=0)
    lc = LearnerCheckpoints(settings, root.parent, run=None, metrics=LearnerMetrics(),
                            log=lambda e, **f: events.append((e, f)), stopping=asyncio.Event())
    return lc.resume(spec), [f for e, f in events if e == "checkpoint_skipped"]


@pytest.mark.parametrize("damage", ["garbage_marker", "damaged_file", "no_marker"])
def test_resume_latest_falls_back_past_any_checkpoint_that_does_not_verify_with_a_warning(
        tmp_path, three, damage):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(three, root)
    newest = root / "step-3"
    if damage == "garbage_marker":
        (newest / "COMPLETE").write_text("{not json")
    elif damage == "damaged_file":
        p = newest / "trainer.json"
        p.write_bytes(p.read_bytes().replace(b"0", b"1", 1))
    else:
        (newest / "COMPLETE").unlink()
    with pytest.raises(StartupError, match="step-3"):              # named: refused, never replaced
        _resume(root, str(newest))
    ckpt, skipped = _resume(root)
    assert ckpt.path == root / "step-2" and ckpt.state["version"] == 2
    assert len(skipped) == 1 and skipped[0]["level"] == "warning"
    assert skipped[0]["resuming_from"] == str(root / "step-2")
    if damage == "no_marker":                  # torn (a write that did not finish): left, not listed
        assert skipped[0]["checkpoint"] == str(newest) and "marker" in skipped[0]["reason"]
    else:                                      # set aside: it would count among keep_last
        aside = Path(skipped[0]["checkpoint"])
        assert aside.name.startswith(".damaged-step-3-") and aside.is_dir() and not newest.exists()
        assert [v for v, _ in Checkpointer(root).complete()] == [1, 2]
        assert _resume(root)[1] == []          # the next resume: nothing to warn about


def test_resume_latest_when_no_checkpoint_verifies_is_one_line(tmp_path, three):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(three, root)
    for v in (1, 2, 3):
        (root / f"step-{v}" / "COMPLETE").write_text("garbage")
    with pytest.raises(StartupError, match="no complete checkpoint .* verifies") as err:
        _resume(root)
    assert "\n" not in str(err.value) and "step-1" in str(err.value)


def test_mark_resumed_on_a_full_disk_is_one_line(tmp_path):
    """The resume's rollback line cannot be written: a startup error (exit 2), not a traceback."""
    settings = SimpleNamespace(dir=None, keep_last=2, failure="continue", save_every=0)
    lc = LearnerCheckpoints(settings, tmp_path, run=SimpleNamespace(run_id="r", version=2),
                            metrics=LearnerMetrics(), log=lambda *a, **k: None, stopping=asyncio.Event())
    lc.resumed_from = tmp_path / "step-2"
    with small_disk("64k") as disk:
        log = JsonlLog(disk / "trained_ids.jsonl")
        fill(disk)
        with pytest.raises(StartupError, match="cannot write .*trained_ids.jsonl") as err:
            lc.mark_resumed(log)
        assert "\n" not in str(err.value)
        log.close()
