"""A checkpoint write that blocks (issue 38): a real learner (its sockets, its watchdog thread) fed
by a protocol-level server; the disk is what is faked: the checkpoint's file writes wait until
the test releases them. The next periodic save waits for the blocked one, so no step comes: the
watchdog says a checkpoint write has run this long and where, ``ctl stacks`` shows the thread in
the checkpoint's commit, and once the disk answers the run goes on (progress_resumed)."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

from learner_testkit import HonestServer, ctl, learner_config, running_learner

from learner.state import checkpoint


async def test_a_checkpoint_write_that_blocks_is_named(tmp_path, tiny_model_dir, monkeypatch):
    released = threading.Event()
    real = checkpoint._write_bytes

    def slow_disk(path: Path, data: bytes) -> None:
        released.wait(60)                      # a disk that does not answer
        real(path, data)
    monkeypatch.setattr(checkpoint, "_write_bytes", slow_disk)
    events: list[tuple[str, dict]] = []
    seen = {name: threading.Event() for name in ("stalled", "progress_resumed")}

    def capture(event: str, **fields) -> None:
        events.append((event, fields))
        if event in seen and (event != "stalled" or fields["reason"] == "checkpoint"):
            seen[event].set()

    cfg = learner_config(tmp_path, save_every=1, watchdog={"stall_s": 1.0})
    async with running_learner(cfg, tiny_model_dir) as svc:
        svc.watchdog.log = capture
        async with HonestServer(svc.endpoints["rollout"]) as server:
            try:
                assert await asyncio.to_thread(seen["stalled"].wait, 60), events
                stalled = next(f for e, f in events if e == "stalled" and f["reason"] == "checkpoint")
                assert re.fullmatch(r"no step for \d+ s: a checkpoint write \(writing the files, version 1\) "
                                    rf"has run \d+ s in {re.escape(str(tmp_path / 'run' / 'checkpoints'))}",
                                    stalled["diagnosis"]), stalled
                reply = await ctl(svc.endpoints["control"], "stacks")
                assert reply.ok, reply.error
                text = Path(reply.result["path"]).read_text()
                assert "## task checkpoint" in text and "in _commit" in text, text[-3000:]
                assert re.search(r'checkpoint\.py", line \d+, in commit\n.*\n.*in slow_disk', text), text[-3000:]
                assert "a checkpoint write (writing the files, version 1)" in svc.status()["waiting_on"]
            finally:
                released.set()
            assert await asyncio.to_thread(seen["progress_resumed"].wait, 60), events
            await server.wait_version(svc.version + 1)
