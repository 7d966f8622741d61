"""Helpers for the learner tests: samples that fit an assignment, a rollout server
played by hand over a real DEALER socket, and a real LearnerService running in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio
from config_kit import nested, rollout_config

import protocol
from learner.config import LearnerConfig
from learner.serve.service import LearnerService


def samples_for(a: protocol.Assignment, *, version: int | None = None, tokens: int = 3,
                reward=lambda i: float(i % 2), **overrides) -> list[protocol.Sample]:
    """A valid group for assignment ``a`` (completion ids 4..; every token of ``version``)."""
    v = a.version if version is None else version
    out = []
    for i in range(a.group_size):
        fields = dict(
            sample_id=protocol.sample_id(a.assignment_id, i), assignment_id=a.assignment_id,
            group_index=i, group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
            completion_token_ids=np.arange(4, 4 + tokens, dtype=np.int32),
            behavior_logprobs=np.full(tokens, -1.5, dtype=np.float32),
            token_versions=np.full(tokens, v, dtype=np.int32), reward=reward(i))
        fields.update(overrides)
        out.append(protocol.Sample(**fields))
    return out


class FakeServer:
    """A rollout server played by the test: a DEALER with its own identity."""

    def __init__(self, endpoint: str, server_id: str, max_concurrency: int = 4, **sockopts):
        self.server_id = server_id
        self.max_concurrency = max_concurrency
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, server_id.encode())
        for opt, value in sockopts.items():
            self.sock.setsockopt(getattr(zmq, opt), value)
        self.sock.connect(endpoint)
        self.seen: list[protocol.Message] = []

    async def send(self, msg: protocol.Message) -> None:
        await self.sock.send_multipart(protocol.encode(msg))

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def recv(self, timeout_s: float = 30.0) -> protocol.Message:
        if not await self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"{self.server_id}: nothing from the learner within {timeout_s}s")
        msg = protocol.decode(await self.sock.recv_multipart())
        self.seen.append(msg)
        return msg

    async def expect(self, cls, timeout_s: float = 30.0,
                     skip=(protocol.WeightsAvailable, protocol.Heartbeat)):
        """The next message of type ``cls`` (skipping the types in ``skip``; the learner echoes
        every heartbeat)."""
        while True:
            msg = await self.recv(timeout_s)
            if isinstance(msg, cls):
                return msg
            if not isinstance(msg, skip):
                raise AssertionError(f"{self.server_id}: expected {cls.__name__}, got {msg!r}")

    async def drain(self, timeout_s: float = 0.2) -> list[protocol.Message]:
        """Everything that arrives until ``timeout_s`` passes without a message."""
        got = []
        while await self.sock.poll(int(timeout_s * 1000)):
            got.append(protocol.decode(await self.sock.recv_multipart()))
        self.seen.extend(got)
        return got

    async def say_hello(self, version: int = 0) -> None:
        await self.send(protocol.Hello(server_id=self.server_id, engine="fake", model="tiny",
                                       version=version, max_concurrency=self.max_concurrency))

    async def hello(self, version: int = 0) -> protocol.Welcome:
        await self.say_hello(version)
        return await self.expect(protocol.Welcome, skip=(protocol.WeightsAvailable, protocol.Assignment,
                                                         protocol.Heartbeat))

    async def work(self, credits: int) -> None:
        await self.send(protocol.WorkRequest(server_id=self.server_id, credits=credits))

    async def heartbeat(self, version: int = 0) -> None:
        await self.send(protocol.Heartbeat(sender_id=self.server_id, version=version))

    async def answer(self, samples: list[protocol.Sample]) -> protocol.Ack:
        await self.send(protocol.RolloutResult(server_id=self.server_id, samples=samples))
        return await self.expect(protocol.Ack, skip=(protocol.WeightsAvailable, protocol.Assignment))

    def close(self) -> None:
        self.sock.close(0)


class HonestServer:
    """Serves a learner the way a real rollout server does, without a model: answers every
    assignment with a valid group and "applies" every announced version at once (no fetch).
    ``await wait_version(v)`` returns once it applied version v (an event, no polling)."""

    def __init__(self, endpoint: str, server_id: str = "good", max_concurrency: int = 4):
        self.endpoint, self.server_id, self.max_concurrency = endpoint, server_id, max_concurrency
        self.version = 0
        self.answered = 0
        self._changed = asyncio.Condition()
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> HonestServer:
        self.task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def wait_version(self, version: int, timeout_s: float = 120.0) -> None:
        async def reached():
            async with self._changed:
                await self._changed.wait_for(lambda: self.version >= version or self.task.done())
        await asyncio.wait_for(reached(), timeout_s)
        if self.task.done():
            self.task.result()
        assert self.version >= version

    async def _serve(self) -> None:
        s = FakeServer(self.endpoint, self.server_id, self.max_concurrency)
        try:
            await s.hello()
            await s.work(self.max_concurrency)
            rejoining = False
            while True:
                msg = await s.recv(timeout_s=120)
                if isinstance(msg, protocol.Assignment):
                    await s.send(protocol.RolloutResult(
                        server_id=self.server_id, samples=samples_for(msg, version=self.version)))
                    self.answered += 1
                    await s.work(msg.group_size)
                elif isinstance(msg, protocol.WeightsAvailable) and msg.version > self.version:
                    await s.send(protocol.WeightsApplied(server_id=self.server_id, version=msg.version,
                                                         checksum=msg.checksum, seconds=0.0))
                    async with self._changed:
                        self.version = msg.version
                        self._changed.notify_all()
                elif isinstance(msg, protocol.Error) and msg.code == "unknown_server":
                    # Lost (e.g. a send to it refused as full): say Hello again, once. Messages
                    # already on the way get more unknown_server answers before the Welcome; like
                    # the real server, one Hello is outstanding at a time.
                    if not rejoining:
                        rejoining = True
                        await s.say_hello(self.version)
                elif isinstance(msg, protocol.Welcome) and rejoining:
                    rejoining = False
                    await s.work(self.max_concurrency)
        finally:
            s.close()
            async with self._changed:
                self._changed.notify_all()


def learner_config(tmp_path: Path, **overrides) -> LearnerConfig:
    """Small and fast: free ports, 1 prompt x 2 completions per step, 1 MiB frame limit."""
    fields = dict(rollout_port=0, weights_port=0, control_port=0, metrics_port=0, total_steps=1000,
                  batch_prompts=1, group_size=2, max_new_tokens=4, max_staleness=1,
                  run_dir=str(tmp_path / "run"), threads=1, exit_on_finish=False,
                  max_message_bytes=1 << 20, weights_chunk_bytes=1 << 20, expiry_interval_s=0.05)
    fields.update(overrides)
    return LearnerConfig(**nested(fields))     # flat names for short (tests/conftest.py nested)


@contextlib.asynccontextmanager
async def running_learner(cfg: LearnerConfig, model_dir: str):
    """A real LearnerService serving in this loop; stopped (and checked not crashed) at exit."""
    svc = LearnerService(cfg, model_dir, run_id="test")
    task = asyncio.create_task(svc.run())
    ready = asyncio.create_task(svc.ready.wait())
    await asyncio.wait([task, ready], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if not svc.ready.is_set():
        ready.cancel()
        if task.done():
            task.result()                  # raises the startup error
        raise AssertionError("learner not ready within 120 s")
    try:
        yield svc
        assert not task.done(), f"learner exited early: {task.result() if not task.exception() else task.exception()!r}"
    finally:
        svc.stopping.set()
        code = await stopped(task, "the learner")
    assert code == 0


@contextlib.asynccontextmanager
async def real_server(svc: LearnerService, model_dir: str, **overrides):
    """A real RolloutService (HF engine) on ``svc``'s rollout endpoint, running in this loop;
    yields ``(server, task)`` and stops it (checked to exit 0) at the end."""
    from rollout_server.service import RolloutService

    fields = dict(learner=svc.endpoints["rollout"], server_id="real", metrics_port=0, threads=1,
                  max_concurrency=8)
    fields.update(overrides)
    server = RolloutService(rollout_config(**fields), model_dir)
    task = asyncio.create_task(server.run())
    try:
        yield server, task
    finally:
        server.stopping.set()
        server.abort.set()
        assert await stopped(task, "the rollout server") == 0


async def stopped(task: asyncio.Task, what: str, timeout_s: float = 60.0):
    """``task``'s result once it ends; if it does not within ``timeout_s``, an AssertionError that
    says where it (and every other task of the loop) was waiting, so a hang can be read from CI."""
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except TimeoutError:
        import io
        out = io.StringIO()
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                t.print_stack(limit=6, file=out)
        import sys
        import traceback
        for ident, frame in sys._current_frames().items():     # the train and engine threads
            out.write(f"thread {ident}:\n" + "".join(traceback.format_stack(frame, limit=6)))
        task.cancel()
        raise AssertionError(f"{what} did not stop within {timeout_s} s; tasks:\n{out.getvalue()}") from None


async def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the loop (the learner runs on it too) until true or ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.01)


def metric(svc: LearnerService, name: str, **labels) -> float:
    return svc.metrics.value(name, labels)


async def ctl(endpoint: str, command: str, timeout_s: float = 10.0, **args) -> protocol.ControlReply:
    """One ControlRequest over a fresh DEALER, as `slipstream ctl` sends it."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(protocol.encode(protocol.ControlRequest(command=command, args=args)))
        if not await sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no control reply within {timeout_s}s")
        return protocol.decode(await sock.recv_multipart())
    finally:
        sock.close(0)


def http_get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body
