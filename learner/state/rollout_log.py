"""The durable rollout log (opt-in, ``learner.rollout_log``): every accepted result on disk before
its Ack leaves, and the accepted-but-untrained ones back in the buffer after a crash.

Why. A checkpoint holds the buffer as it was between two steps; results accepted after it were
acknowledged — their servers forgot them — and die with a crashed learner, so their prompts are
generated again. The log keeps them: the learner appends each result (its accepted samples) to a
segment file, then sends the Ack; a resumed learner puts the ones no step of its lineage trained
back into the buffer.

Files. ``<path>/life-<L>-<S>.log``: life ``L`` is one learner process (0001, 0002, ... : each start
of a run on this directory), ``S`` its segments, a new one when the next record would pass
``segment_bytes``. Every record::

    magic b"SRL1" | u32 length | u32 crc32(length bytes + payload) | payload      (little-endian)
    payload = msgpack [kind, meta, frames]

``kind`` is ``"life"`` (first record of each life: run id, start version, start time, the
checkpoint resumed from) or ``"result"``: ``frames`` are ``protocol.encode`` of a
``RolloutResult`` holding only the samples acknowledged ``accepted`` (and not failed), byte for
byte what the protocol would send — one record per result message, since one message is one Ack
and one write; ``meta`` has the life, the learner version at acceptance, the time. The reader
(:class:`LogReader`) checks length and CRC: a record cut off at the end of a segment (a crash
mid-write) is *torn*, one whose CRC does not match is *corrupt*; both are skipped and counted,
and reading resynchronises at the next magic that starts a valid record. A segment that cannot be
read at all (permissions, a directory in its place, an I/O error) is a one-line start-up error
(:func:`unreadable`), not a silent loss of its records.

Durability (``fsync``). The record is written (``os.write``, no user-space buffer) before the Ack
is sent, so an acknowledged result survives a crash of the learner process in every mode.
``step`` (default) fsyncs once per policy step (and at rotation and exit): a crash of the whole
machine loses at most the results acknowledged since the last step. ``record`` fsyncs every
record before its Ack (in a thread; the rollout socket waits, the loop does not): nothing
acknowledged is ever lost, at one fsync per result message (about 5 ms on this machine's disk,
tests/bench/bench_rollout_log.py). A write that fails (disk full) sends no Ack at all: the server
keeps the result and re-sends it after a reconnect (the buffer already has it: a duplicate), the
failure is an event and ``slipstream_rollout_log_failures_total``.

What comes back after ``--resume`` from checkpoint ``c`` (:func:`untrained_groups`), exactly:
samples logged by the latest life ``L`` of the directory that

- were accepted at a learner version ≥ ``c`` and are unknown to the checkpoint's buffer (not in
  its de-duplication window, which holds every sample it accepted): accepted after the checkpoint;
- are not in ``trained_ids.jsonl`` as the resumed run reads it (:func:`learner.state.checkpoint.
  effective_trained_ids`: steps at or past ``c`` of the crashed life were rolled back, so what
  they trained is untrained again and comes back);
- have no token newer than ``c``: tokens of versions past ``c`` came from weights the resume
  rolled back — a new life's version ``c + 1`` is other weights under the same number — so such a
  sample is counted ``rolled_back`` and its prompt generated again;
- and belong to a group the buffer can take whole: a group still open in the checkpoint's buffer
  gets its members through ``buffer.put`` (the lease is re-issued for what is missing); a group of
  an assignment issued after the checkpoint comes back only complete
  (:meth:`buffer.RolloutBuffer.restore_group`: issued and accepted at once), else ``incomplete``.

The lineage: ``L`` must have written checkpoint ``c`` (its ``saved_at`` is after ``L`` started) or
started from it (``c`` is ``L``'s start version); a resume from an older checkpoint restores
nothing (an event says so). Restored samples are appended to the new life's log (so a second crash
finds them) and their assignment ids are passed over when the new life issues its own (the prompt
too, when it is the same one: its work is back). Staleness after the resume is the buffer's usual
``c − min(token_versions)`` at the resumed version, growing as training goes on; under
``stale_policy: drop`` a group already over η is dropped at once (counted ``stale``), under
``correct`` it is trained with importance correction. They count in the gate as accepted, which
is why generation does not redo them.
"""

from __future__ import annotations

import asyncio
import os
import re
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

import protocol
from learner.config import FSYNC_POLICIES, RolloutLogSettings
from protocol.plumbing.process import fsync_path

MAGIC = b"SRL1"
_HEAD = struct.Struct("<4sII")          # magic, payload length, crc32(length bytes + payload)
_LEN = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 30
SEGMENT_RE = re.compile(r"^life-(\d{4,})-(\d{6,})\.log$")
LIFE, RESULT = "life", "result"




# ---- records ---------------------------------------------------------------------------------------

def encode_record(kind: str, meta: dict, frames: list = ()) -> bytes:
    """One record: header (magic, length, CRC) + msgpack payload."""
    payload = msgpack.packb([kind, meta, [bytes(f) for f in frames]], use_bin_type=True)
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"rollout log record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
    n = _LEN.pack(len(payload))
    return _HEAD.pack(MAGIC, len(payload), zlib.crc32(payload, zlib.crc32(n))) + payload


@dataclass(slots=True)
class LogRecord:
    kind: str
    meta: dict
    result: protocol.RolloutResult | None     # for kind "result"
    segment: str
    offset: int


def unreadable(path: Path, e: OSError) -> protocol.StartupError:
    """A segment (or the log directory) that cannot be read, as the one line the user sees.
    Refused rather than skipped: its records are acknowledged results nothing else holds, and
    a permission or a mount is fixed in a minute; moving the file away is the user's choice."""
    what = "rollout log directory" if path.is_dir() and not SEGMENT_RE.match(path.name) else "rollout log segment"
    return protocol.StartupError(
        f"{what} {path} cannot be read ({e.strerror or e}); make it readable, or move it out of "
        "the log directory to go on without its records")


@dataclass
class LogReader:
    """Every valid record of a log directory, in order (segments sorted by life, then number).

    Counters after (or during) iteration: ``torn`` (a record cut off at a segment's end),
    ``corrupt`` (CRC mismatch or a payload that does not decode; skipped), ``skipped_bytes``
    (bytes not part of a valid record), ``records``, ``segments``, ``bytes``.
    """

    root: Path
    life: int | None = None                   # read only this life's segments (None: all)
    torn: int = 0
    corrupt: int = 0
    skipped_bytes: int = 0
    records: int = 0
    segments: int = 0
    bytes: int = 0
    counted: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    def _found(self) -> list[tuple[int, int, Path]]:
        if not self.root.is_dir():
            return []
        try:
            names = [p for p in self.root.iterdir()]
        except OSError as e:
            raise unreadable(self.root, e) from None
        return sorted((int(m.group(1)), int(m.group(2)), p) for p in names
                      if (m := SEGMENT_RE.match(p.name)))

    def segment_paths(self) -> list[Path]:
        return [p for life, _, p in self._found() if self.life is None or life == self.life]

    def last_life(self) -> int | None:
        """The newest life with a segment in the directory (None: an empty log)."""
        found = self._found()
        return found[-1][0] if found else None

    def __iter__(self) -> Iterator[LogRecord]:
        self.torn = self.corrupt = self.skipped_bytes = self.records = self.segments = self.bytes = 0
        for path in self.segment_paths():
            self.segments += 1
            try:
                data = path.read_bytes()
            except OSError as e:
                raise unreadable(path, e) from None
            self.bytes += len(data)
            yield from self._segment(path.name, data)
        self.counted = True

    def _segment(self, name: str, data: bytes) -> Iterator[LogRecord]:
        pos, end = 0, len(data)
        while pos < end:
            rec, nxt, problem = self._at(name, data, pos)
            if rec is not None:
                self.records += 1
                yield rec
                pos = nxt
                continue
            # A bad record: resynchronise at the next magic that starts a valid record.
            scan = data.find(MAGIC, pos + 1)
            while scan != -1 and self._at(name, data, scan)[0] is None:
                scan = data.find(MAGIC, scan + 1)
            stop = end if scan == -1 else scan
            if problem == "torn" and scan == -1:
                self.torn += 1
            else:
                self.corrupt += 1
            self.skipped_bytes += stop - pos
            pos = stop

    @staticmethod
    def _at(name: str, data: bytes, pos: int) -> tuple[LogRecord | None, int, str]:
        """(record, next offset, "") or (None, 0, "torn" | "corrupt") for the bytes at ``pos``."""
        if len(data) - pos < _HEAD.size:
            return None, 0, "torn"
        magic, n, crc = _HEAD.unpack_from(data, pos)
        if magic != MAGIC or n > MAX_RECORD_BYTES:
            return None, 0, "corrupt"
        start = pos + _HEAD.size
        if start + n > len(data):
            return None, 0, "torn"
        payload = data[start:start + n]
        if zlib.crc32(payload, zlib.crc32(_LEN.pack(n))) != crc:
            return None, 0, "corrupt"
        try:
            kind, meta, frames = msgpack.unpackb(payload, raw=False)
            result = None
            if kind == RESULT:
                result = protocol.decode(list(frames))
                if not isinstance(result, protocol.RolloutResult):
                    raise protocol.ProtocolError(f"a {type(result).__name__} in a result record")
            elif kind != LIFE:
                raise ValueError(f"unknown record kind {kind!r}")
            if not isinstance(meta, dict):
                raise ValueError("meta is not a map")
        except (ValueError, TypeError, protocol.ProtocolError, msgpack.UnpackException):
            return None, 0, "corrupt"
        return LogRecord(kind, meta, result, name, pos), start + n, ""

    def stats(self) -> dict[str, int]:
        return {"segments": self.segments, "records": self.records, "bytes": self.bytes,
                "torn": self.torn, "corrupt": self.corrupt, "skipped_bytes": self.skipped_bytes}


# ---- writing ---------------------------------------------------------------------------------------

class RolloutLogWriter:
    """Appends records to the segments of one life (a new life number per writer)."""

    def __init__(self, root: str | Path, segment_bytes: int = 64 << 20, fsync: str = "step"):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync {fsync!r} not in {FSYNC_POLICIES}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = int(segment_bytes)
        self.fsync = fsync
        lives = [int(m.group(1)) for p in self.root.iterdir() if (m := SEGMENT_RE.match(p.name))]
        self.life = max(lives, default=0) + 1
        self.segment = 0
        self.fd: int | None = None
        self.size = 0
        self.written_bytes = 0
        self.written_records = 0
        self.dirty = False                    # written since the last fsync
        self._reopen = True                   # the next append starts a new segment

    @property
    def path(self) -> Path:
        return self.root / f"life-{self.life:04d}-{self.segment:06d}.log"

    def _rotate(self) -> None:
        if self.fd is not None:
            if self.dirty:
                os.fsync(self.fd)
                self.dirty = False
            os.close(self.fd)
            self.fd = None
        self.segment += 1
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.size = 0
        fsync_path(self.root)                 # the new file's name is durable too
        self._reopen = False

    def _write(self, fd: int, data: bytes) -> int:
        """One place for the write (a test makes it fail)."""
        return os.write(fd, data)

    def append(self, kind: str, meta: dict, frames: list = ()) -> int:
        """Write one record (reaching the OS before this returns); returns its size in bytes.
        OSError when it cannot be written: the next append starts a new segment."""
        data = encode_record(kind, meta, frames)
        if self._reopen or (self.size and self.size + len(data) > self.segment_bytes):
            self._rotate()
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += self._write(self.fd, view[done:])
        except OSError:
            self._reopen = True               # what is written of it is a torn record
            raise
        self.size += len(data)
        self.written_bytes += len(data)
        self.written_records += 1
        self.dirty = True
        return len(data)

    def sync(self) -> None:
        """fsync the current segment (a no-op when nothing was written since the last one)."""
        if self.fd is not None and self.dirty:
            self.dirty = False
            os.fsync(self.fd)

    async def sync_async(self) -> None:
        """:meth:`sync` in a thread, on a duplicate descriptor (a rotation meanwhile is safe)."""
        if self.fd is None or not self.dirty:
            return
        self.dirty = False
        fd = os.dup(self.fd)
        try:
            await asyncio.to_thread(os.fsync, fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd is not None:
            try:
                self.sync()
            finally:
                os.close(self.fd)
                self.fd = None


def accepted_result(msg: protocol.RolloutResult, ack: protocol.Ack) -> protocol.RolloutResult | None:
    """The samples of ``msg`` acknowledged ``accepted`` (and not failed), or None if there are none."""
    keep = [s for s, st in zip(msg.samples, ack.statuses, strict=True)
            if st == "accepted" and s.failed is None]
    return protocol.RolloutResult(server_id=msg.server_id, samples=keep) if keep else None


# ---- what comes back after a resume --------------------------------------------------------------

def untrained_groups(records: Iterator[LogRecord], *, version: int, saved_at: float,
                     known_ids: set[str], trained_ids: set[str]) -> tuple[dict[str, list], Counter]:
    """The samples to put back after a resume from the checkpoint of ``version`` written at
    ``saved_at`` (module docstring), grouped by assignment id in log order; and the reasons
    the others were left out (in samples; ``lineage`` counts none but says why nothing came back).

    ``records``: those of the last life (``LogReader(root, life=last_life)``), read as a stream
    (only the candidates are kept). The first life record decides the lineage.
    """
    why: Counter = Counter()
    groups: dict[str, list] = {}
    seen: set[str] = set()
    last = None
    for rec in records:
        if rec.kind == LIFE:
            if last is not None:
                continue
            last = rec.meta.get("life")
            if not (saved_at >= float(rec.meta.get("started_at", 0))
                    or version == int(rec.meta.get("start_version", -1))):
                why["lineage"] += 1
                return {}, why
            continue
        if last is None or rec.meta.get("life") != last:
            continue
        accepted_at = int(rec.meta.get("version", -1))
        for s in rec.result.samples:
            sid = s.sample_id
            if sid in seen:
                why["duplicate"] += 1
                continue
            seen.add(sid)
            tv = s.token_versions
            if accepted_at < version or sid in known_ids:
                why["before_checkpoint"] += 1
            elif sid in trained_ids:
                why["trained"] += 1
            elif len(tv) and int(np.max(tv)) > version:
                why["rolled_back"] += 1
            else:
                groups.setdefault(s.assignment_id, []).append(s)
    return groups, why


async def restore_groups(buffer: Any, groups: dict[str, list], version: int) -> tuple[list, Counter]:
    """Put ``groups`` (from :func:`untrained_groups`) into ``buffer`` at ``version``: members of a
    group open in the buffer through ``put``, complete new groups through ``restore_group``.
    Returns the samples accepted back and the outcome of every sample (``accepted``, ``stale``,
    ``duplicate``, ``invalid``, ``incomplete``)."""
    back: list = []
    outcome: Counter = Counter()
    for aid, samples in groups.items():
        samples = sorted(samples, key=lambda s: s.group_index)
        if buffer.is_open(aid):
            statuses = [await buffer.put(s, version) for s in samples]
        elif len(samples) == buffer.group_size and [s.group_index for s in samples] == list(
                range(buffer.group_size)):
            try:
                statuses = await buffer.restore_group(samples, version)
            except ValueError:                # the id is known to the buffer (finished before)
                statuses = ["duplicate"] * len(samples)
        else:
            outcome["incomplete"] += len(samples)
            continue
        for s, st in zip(samples, statuses, strict=True):
            outcome[str(st)] += 1
            if str(st) == "accepted":
                back.append(s)
    return back, outcome


# ---- the learner's side ------------------------------------------------------------------------

class RolloutLogFailed(Exception):
    """A result could not be logged: its Ack must not be sent (learner.serve.ingress.IntakePath)."""


class LearnerRolloutLog:
    """The learner's rollout log: handed the run state (run id, version), the buffer samples come
    back into, the metrics and the event log. Opened at start, after a resume's checkpoint was
    applied (:meth:`open`, told where it is); every accepted result goes through :meth:`receive`."""

    def __init__(self, settings: RolloutLogSettings, run_dir: str | Path, *, run: Any, buffer: Any,
                 metrics: Any, log: Callable[..., None]):
        self.settings, self.run, self.buffer, self.log = settings, run, buffer, log
        self.run_dir = Path(run_dir)
        self.root = Path(settings.path) if settings.path else self.run_dir / "rollout_log"
        self.writer: RolloutLogWriter | None = None
        self.skip_assignments: dict[str, np.ndarray] = {}   # restored id -> its prompt's tokens
        m = metrics                           # a learner.metrics.LearnerMetrics: defined there
        self.m_bytes = m.rollout_log_bytes
        self.m_failures = m.rollout_log_failures
        self.m_restored = m.rollout_log_restored

    async def open(self, resumed_from: Path | None) -> None:
        """A new life; after a resume (from the checkpoint ``resumed_from``), the untrained samples
        of the last life back into the buffer."""
        ckpt = resumed_from
        plan = None
        if ckpt is not None:
            import json

            from learner.state.checkpoint import effective_trained_ids

            state = json.loads((Path(ckpt) / "state.json").read_text())
            trained = effective_trained_ids(self.run_dir / "trained_ids.jsonl")
            reader = LogReader(self.root)
            reader.life = reader.last_life()
            plan = untrained_groups(iter(reader), version=self.run.version,
                                    saved_at=float(state.get("saved_at", 0.0)),
                                    known_ids=set(state["buffer"].get("seen", [])),
                                    trained_ids=set(trained))
            log_stats = reader.stats()
        s = self.settings
        try:
            self.writer = RolloutLogWriter(self.root, s.segment_bytes, s.fsync)
        except OSError as e:
            raise protocol.StartupError(
                f"learner.rollout_log.path {str(self.root)!r} cannot be written ({e.strerror or e}); "
                "point it at a writable directory") from None
        self.writer.append(LIFE, {"life": self.writer.life, "run_id": self.run.run_id,
                                  "start_version": self.run.version, "started_at": time.time(),
                                  "resumed_from": str(ckpt) if ckpt else None})
        if plan is None:
            self.writer.sync()
            return
        groups, why = plan
        back, outcome = await restore_groups(self.buffer, groups, self.run.version)
        for s_ in back:
            self.skip_assignments.setdefault(s_.assignment_id, s_.prompt_token_ids)
        if back:
            self.writer.append(RESULT, {"life": self.writer.life, "version": self.run.version,
                                        "time": time.time(), "restored": True},
                               protocol.encode(protocol.RolloutResult(server_id="rollout_log",
                                                                      samples=back)))
        self.writer.sync()
        self.m_restored.inc(len(back))
        self.log("rollout_log_restored", samples=len(back), groups=len({s_.assignment_id for s_ in back}),
                outcome=dict(outcome), left_out=dict(why), log=log_stats, resumed_version=self.run.version,
                **({"hint": "the checkpoint is older than the last life of the log: nothing restored"}
                   if why.get("lineage") else {}))

    async def receive(self, msg: protocol.RolloutResult, ack: protocol.Ack) -> bool:
        """Log the accepted samples of ``msg`` before its ``ack`` goes out; False when the write
        failed (then no Ack may be sent)."""
        res = accepted_result(msg, ack)
        if res is None:
            return True
        w = self.writer
        try:
            n = w.append(RESULT, {"life": w.life, "version": self.run.version, "time": time.time()},
                         protocol.encode(res))
            if self.settings.fsync == "record":
                await w.sync_async()
        except OSError as e:
            self.m_failures.inc()
            self.log("rollout_log_failed", level="error", server=msg.server_id,
                         samples=len(res.samples), error=f"{type(e).__name__}: {e}"[:300],
                         directory=str(self.root), action="no Ack sent: the server keeps the result",
                         hint="free disk space or make learner.rollout_log.path writable")
            return False
        self.m_bytes.inc(n)
        return True

    def passed_over(self, assignment_id: str, prompt_token_ids: Any) -> tuple[bool, bool]:
        """For a new assignment id: (skip the id, skip the prompt too). A restored group's id is
        never issued again; its prompt is not either when the data stream hands out the same one."""
        tokens = self.skip_assignments.pop(assignment_id, None)
        if tokens is None:
            return False, False
        return True, bool(np.array_equal(tokens, prompt_token_ids))

    async def after_step(self) -> None:
        """``fsync: step``: this step's records to the disk (in a thread). A failure is an event and
        a count, not the end of the run: those records did reach the OS before their Acks."""
        if self.settings.fsync == "step" and self.writer is not None:
            try:
                await self.writer.sync_async()
            except OSError as e:
                self._sync_failed(e)

    def _sync_failed(self, e: OSError) -> None:
        self.m_failures.inc()
        self.log("rollout_log_failed", level="error", error=f"{type(e).__name__}: {e}"[:300],
                     directory=str(self.root), action="fsync failed: the last step's records are in "
                     "the OS, not known to be on disk", hint="check the disk of learner.rollout_log.path")

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                self._sync_failed(e)


__all__ = ["LearnerRolloutLog", "RolloutLogFailed", "LogReader", "LogRecord",
           "RolloutLogWriter", "accepted_result", "encode_record", "restore_groups", "untrained_groups"]
