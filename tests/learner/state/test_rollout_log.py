"""The rollout log's files: round trip, rotation, torn and corrupt records, and which samples a
resume takes back (learner.state.rollout_log). Pure file I/O; no model."""

from __future__ import annotations

import numpy as np
import pytest

import protocol
from learner.config import RolloutLogSettings
from learner.metrics import LearnerMetrics
from learner.state.rollout_log import (
    LIFE,
    RESULT,
    LearnerRolloutLog,
    LogReader,
    RolloutLogWriter,
    accepted_result,
    untrained_groups,
)
from learner.state.run_state import RunState


def sample(aid: str, i: int, versions=(0, 0), reward: float = 0.0, size: int = 2) -> protocol.Sample:
    n = len(versions)
    return protocol.Sample(
        sample_id=protocol.sample_id(aid, i), assignment_id=aid, group_index=i, group_size=size,
        prompt_token_ids=np.arange(5, dtype=np.int32), completion_token_ids=np.arange(3, 3 + n, dtype=np.int32),
        behavior_logprobs=np.linspace(-2, -1, n).astype(np.float32),
        token_versions=np.asarray(versions, np.int32), reward=reward)


def result(server: str, samples) -> protocol.RolloutResult:
    return protocol.RolloutResult(server_id=server, samples=list(samples))


def write(root, results, *, version=0, segment_bytes=1 << 20, life_meta=None):
    w = RolloutLogWriter(root, segment_bytes)
    w.append(LIFE, {"life": w.life, "start_version": 0, "started_at": 0.0, **(life_meta or {})})
    for r in results:
        w.append(RESULT, {"life": w.life, "version": version}, protocol.encode(r))
    w.close()
    return w


def test_round_trip_keeps_the_protocol_bytes_and_order(tmp_path):
    rs = [result("s1", [sample(f"a{k}", 0, reward=k), sample(f"a{k}", 1, reward=-k)]) for k in range(5)]
    write(tmp_path, rs, version=3)
    reader = LogReader(tmp_path)
    recs = list(reader)
    assert [r.kind for r in recs] == [LIFE] + [RESULT] * 5
    for got, want in zip(recs[1:], rs, strict=True):
        assert got.result.server_id == "s1" and got.meta["version"] == 3
        for a, b in zip(got.result.samples, want.samples, strict=True):
            assert a.sample_id == b.sample_id and a.reward == b.reward
            assert np.array_equal(a.behavior_logprobs, b.behavior_logprobs)
            assert np.array_equal(a.token_versions, b.token_versions)
    assert reader.stats()["torn"] == 0 and reader.stats()["corrupt"] == 0
    # A second writer on the directory is a new life: its own segment names, older ones kept.
    w2 = write(tmp_path, rs[:1])
    assert w2.life == 2 and len(LogReader(tmp_path).segment_paths()) == 2


def test_segments_rotate_at_segment_bytes(tmp_path):
    rs = [result("s", [sample(f"a{k}", 0), sample(f"a{k}", 1)]) for k in range(40)]
    write(tmp_path, rs, segment_bytes=4096)
    paths = LogReader(tmp_path).segment_paths()
    assert len(paths) >= 3          # about 300 bytes a record, 40 of them
    assert all(p.stat().st_size <= 4096 for p in paths)
    ids = [s.sample_id for r in LogReader(tmp_path) if r.kind == RESULT for s in r.result.samples]
    assert ids == [s.sample_id for r in rs for s in r.samples]


def test_a_torn_tail_and_a_flipped_byte_are_skipped_and_counted(tmp_path):
    rs = [result("s", [sample(f"a{k}", 0), sample(f"a{k}", 1)]) for k in range(6)]
    write(tmp_path, rs)
    [seg] = LogReader(tmp_path).segment_paths()
    recs = list(LogReader(tmp_path))
    data = bytearray(seg.read_bytes())
    # Cut the last record in half (a crash mid-write).
    last = recs[-1].offset
    seg.write_bytes(bytes(data[: last + (len(data) - last) // 2]))
    reader = LogReader(tmp_path)
    got = [r.result.samples[0].assignment_id for r in reader if r.kind == RESULT]
    assert got == ["a0", "a1", "a2", "a3", "a4"] and reader.torn == 1 and reader.corrupt == 0
    # Flip one byte inside the third result record: only that one is lost, reading goes on.
    data = bytearray(seg.read_bytes())
    data[recs[3].offset + 40] ^= 0xFF
    seg.write_bytes(bytes(data))
    reader = LogReader(tmp_path)
    got = [r.result.samples[0].assignment_id for r in reader if r.kind == RESULT]
    assert got == ["a0", "a1", "a3", "a4"] and reader.corrupt == 1 and reader.torn == 1
    assert reader.skipped_bytes > 0


def test_a_failed_write_leaves_a_torn_record_the_reader_skips(tmp_path):
    w = RolloutLogWriter(tmp_path, 1 << 20)
    w.append(LIFE, {"life": 1})
    w.append(RESULT, {"life": 1, "version": 0}, protocol.encode(result("s", [sample("a1", 0)])))
    real = w._write

    def half(fd, data):                       # half the record reaches the file, then ENOSPC
        real(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")
    w._write = half
    try:
        w.append(RESULT, {"life": 1, "version": 0}, protocol.encode(result("s", [sample("a2", 0)])))
        raise AssertionError("the write should have failed")
    except OSError:
        pass
    w._write = real
    w.append(RESULT, {"life": 1, "version": 0}, protocol.encode(result("s", [sample("a3", 0)])))
    w.close()
    reader = LogReader(tmp_path)
    got = [r.result.samples[0].assignment_id for r in reader if r.kind == RESULT]
    assert got == ["a1", "a3"] and reader.torn == 1 and reader.segments == 2


def test_only_accepted_unfailed_samples_are_logged():
    msg = result("s", [sample("a", 0), sample("a", 1), sample("b", 0)])
    ack = protocol.Ack(sample_ids=[s.sample_id for s in msg.samples],
                       statuses=["accepted", "duplicate", "accepted"])
    assert [s.sample_id for s in accepted_result(msg, ack).samples] == ["a/0", "b/0"]
    assert accepted_result(msg, protocol.Ack(sample_ids=ack.sample_ids, statuses=["stale"] * 3)) is None


def test_which_samples_a_resume_takes_back(tmp_path):
    """Resume from checkpoint version 2, written at t=100 by life 1 (started at t=0)."""
    write(tmp_path, [
        result("s", [sample("early", 0, (1, 1)), sample("early", 1, (1, 1))]),   # accepted at v1
    ], version=1)
    # the same life, later records (the writer above is closed: append one more life-1 segment by hand)
    w = RolloutLogWriter(tmp_path, 1 << 20)
    w.life = 1
    w.segment = 1
    for msg, v in [
        (result("s", [sample("known", 0, (2,))]), 2),                          # in the checkpoint
        (result("s", [sample("back", 0, (1, 2)), sample("back", 1, (2,))]), 2),  # comes back
        (result("s", [sample("trained", 0, (2,))]), 3),                          # trained_ids
        (result("s", [sample("future", 0, (2, 3))]), 3),                         # token of v3
        (result("t", [sample("back", 0, (1, 2))]), 3),                           # second copy
    ]:
        w.append(RESULT, {"life": 1, "version": v}, protocol.encode(msg))
    w.close()
    groups, why = untrained_groups(iter(LogReader(tmp_path)), version=2, saved_at=100.0,
                                   known_ids={"known/0"}, trained_ids={"trained/0"})
    assert list(groups) == ["back"] and [s.group_index for s in groups["back"]] == [0, 1]
    assert why == {"before_checkpoint": 3, "trained": 1, "rolled_back": 1, "duplicate": 1}
    # A checkpoint older than the last life's start (and not its start version): nothing.
    write(tmp_path, [], life_meta={"start_version": 5, "started_at": 200.0})
    reader = LogReader(tmp_path)
    reader.life = reader.last_life()
    assert reader.life == 2
    groups, why = untrained_groups(iter(reader), version=2, saved_at=100.0,
                                   known_ids=set(), trained_ids=set())
    assert groups == {} and why == {"lineage": 1}


async def test_a_log_directory_that_cannot_be_written_is_a_startup_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    log = LearnerRolloutLog(RolloutLogSettings(path=str(tmp_path / "file" / "log")), tmp_path,
                            run=RunState("r"), buffer=None, metrics=LearnerMetrics(),
                            log=lambda *a, **k: None)
    with pytest.raises(protocol.StartupError, match="learner.rollout_log.path"):
        await log.open(None)
