"""Test kit for the rollout server: a learner ROUTER driven by hand, weights published in memory,
bounded waits."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import torch
import zmq
import zmq.asyncio

import protocol
from learner.train.weights import flatten
from protocol.chunks import chunk_checksum, combine_checksums, split_chunks

QUIET = (protocol.Heartbeat, protocol.WorkRequest, protocol.WeightsApplied)


class FakeLearner:
    """The learner's rollout ROUTER, driven by hand (a real ZeroMQ socket)."""

    def __init__(self, port: int = 0):
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    async def recv(self, timeout_s: float = 60) -> tuple[bytes, protocol.Message]:
        if not await self.sock.poll(timeout_s * 1000):
            raise AssertionError(f"nothing from the server within {timeout_s}s")
        ident, *frames = await self.sock.recv_multipart()
        return ident, protocol.decode(frames)

    async def expect(self, cls, timeout_s: float = 60, skip=QUIET) -> tuple[bytes, protocol.Message]:
        """The next message of type ``cls``, skipping heartbeats (and WorkRequests unless asked)."""
        while True:
            ident, msg = await self.recv(timeout_s)
            if isinstance(msg, cls):
                return ident, msg
            if not isinstance(msg, skip):
                raise AssertionError(f"expected {cls.__name__}, got {msg!r}")

    async def until(self, cls, timeout_s: float = 60) -> list[protocol.Message]:
        """Every message up to and including the next one of type ``cls``."""
        out = []
        while True:
            _, msg = await self.recv(timeout_s)
            out.append(msg)
            if isinstance(msg, cls):
                return out

    async def send(self, ident: bytes, msg: protocol.Message) -> None:
        await self.sock.send_multipart([ident, *protocol.encode(msg)])

    async def send_raw(self, ident: bytes, frames: list[bytes]) -> None:
        await self.sock.send_multipart([ident, *frames])

    async def welcome(self, ident: bytes, weights_endpoint: str = "tcp://127.0.0.1:1",
                      version: int = 0) -> None:
        await self.send(ident, protocol.Welcome(learner_id="fake", run_id="run", version=version,
                                                weights_endpoint=weights_endpoint))

    async def ack(self, ident: bytes, samples: list[protocol.Sample]) -> None:
        await self.send(ident, protocol.Ack(sample_ids=[s.sample_id for s in samples],
                                            statuses=["accepted"] * len(samples)))

    def close(self) -> None:
        self.sock.close(0)


def assignment(aid: str, tokens: list[int], group_size: int = 2, answer: str = "7",
               max_new_tokens: int = 5, burst_left: int = -1, **sampling) -> protocol.Assignment:
    return protocol.Assignment(
        assignment_id=aid, prompt_id=aid, prompt_token_ids=np.array(tokens, dtype=np.int32),
        group_size=group_size, version=0, prompt_text="3+4=",
        sampling=protocol.SamplingParams(max_new_tokens=max_new_tokens, **sampling),
        metadata={"answer": answer}, deadline_s=60.0, burst_left=burst_left)


def publish(version: int, named: list[tuple[str, torch.Tensor]], chunk_bytes: int,
            kind: str = "full") -> tuple[protocol.WeightsAvailable, list[bytes]]:
    """A manifest and its chunks, laid out as the learner publishes them."""
    flat, specs = flatten(named)
    chunks = [bytes(c) for c in split_chunks(flat.numpy().tobytes(), chunk_bytes)]
    sums = [chunk_checksum(c) for c in chunks]
    manifest = protocol.WeightsAvailable(
        version=version, kind=kind, tensors=specs, total_bytes=flat.numel(), chunk_bytes=chunk_bytes,
        num_chunks=len(chunks), checksum=combine_checksums(sums), chunk_checksums=sums)
    return manifest, chunks


def chunk_reply(manifest: protocol.WeightsAvailable, chunks: list[bytes], index: int) -> protocol.Message:
    if index >= len(chunks):
        return protocol.Error(code="bad_chunk", message=f"chunk {index} >= {len(chunks)}")
    return protocol.WeightChunk(version=manifest.version, index=index,
                                checksum=manifest.chunk_checksums[index], data=chunks[index])


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30, what: str = "condition",
                     interval_s: float = 0.02) -> None:
    """A bounded wait for state another task or thread changes without an event to await."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(interval_s)


async def wait_event(svc, predicate: Callable[[], bool], timeout_s: float = 30,
                     what: str = "condition") -> None:
    """Wait on ``svc.progress`` (set on every ack, finished batch and link event) until
    ``predicate()`` holds, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        svc.progress.clear()
        if predicate():
            return
        try:
            await asyncio.wait_for(svc.progress.wait(), left)
        except TimeoutError:
            pass


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
