"""The weights server: one snapshot per published version, announced by manifest, served in chunks.

Publishing a version (docs/design.md §5) copies the tensors into one flat host buffer in the layout of
:func:`learner.train.weights.layout` — a snapshot, so the next policy step may change the parameters
while servers are still fetching — and cuts it into ``chunk_bytes`` chunks with a checksum each
(:mod:`protocol.chunks`). Chunks go out as zero-copy views of the snapshot; every server fetching
a version reads the same snapshot, so N servers cost one copy, not N.

Off the train loop's critical path, in three steps:

``snapshot`` (the only step the train loop waits for)
    one copy per tensor into a reused host buffer (:class:`HostBuffers`). From CUDA the buffer
    is pinned and the copies are asynchronous on the current stream, with an event recorded
    after them: the train loop waits only for the copies to be queued, and the next optimizer
    step, queued after them on the same stream, cannot change what they read.
``prepare`` (a worker thread, while step v + 1 runs)
    waits for the event, cuts the chunks and checksums them: the manifest.
``install`` (on the loop)
    serves the snapshot from then on; the caller announces the manifest.

:class:`Publisher` runs the last two in version order in one background task. Versions are
announced in order; a snapshot still waiting for the task when a newer one arrives is superseded
(dropped, counted, never announced): a server wants the newest weights, and announcing a
version already older than the next one only makes it fetch twice. The one being prepared is
never interrupted, so some version is announced after every prepare.

The newest ``keep`` versions stay: a server still fetching version v when v + 1 is published can
finish. An older snapshot is dropped from the table at once; its buffer goes back to the pool as
soon as nothing refers to it any more — no chunk of it is still queued in ZeroMQ (a queued
zero-copy frame holds a reference to its bytes, released by pyzmq once libzmq has sent it) and
nobody holds the snapshot. The pool sees that through a finalizer on the snapshot's numpy view of
the buffer, which every chunk view (and so every queued frame) keeps alive. Memory is then about
``keep`` + 2 buffers of one publish: the versions kept, one being prepared, one waiting.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

import protocol
from learner.train.weights import copy_into, layout
from protocol.chunks import chunk_checksum, combine_checksums, split_chunks, xor_delta
from protocol.plumbing.process import trace


class HostBuffers:
    """Flat uint8 host buffers, reused: allocating (and, from CUDA, pinning) hundreds of MiB per
    publish costs more than the copy (first-touch page faults; ``cudaHostAlloc``).

    ``take`` returns a free buffer of exactly the size asked for, else a new one; ``give`` (any
    thread: pyzmq releases zero-copy frames on its own thread) returns one. At most ``spare``
    free buffers are kept; beyond that they are freed.
    """

    def __init__(self, spare: int = 2):
        self.spare = spare
        self.allocated = 0                 # buffers allocated so far (a reuse allocates nothing)
        self._free: list[torch.Tensor] = []
        # give() only appends here (atomic, no lock): it runs from finalizers, which may fire
        # on any thread and at any allocation, even inside take().
        self._returned: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()

    def _collect(self) -> None:
        while self._returned:
            self._free.append(self._returned.popleft())
        del self._free[:max(0, len(self._free) - self.spare)]      # keep the newest ``spare``

    def take(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        with self._lock:
            self._collect()
            for i, buf in enumerate(self._free):
                if buf.numel() == nbytes and buf.is_pinned() == pin:
                    return self._free.pop(i)
            self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give(self, buf: torch.Tensor) -> None:
        self._returned.append(buf)

    @property
    def free(self) -> int:
        """Buffers waiting to be reused."""
        with self._lock:
            self._collect()
            return len(self._free)


class Snapshot:
    """One version's bytes (``flat``, in the manifest's layout) and, once prepared, its manifest
    and the chunk views of those bytes. ``started`` is when the train loop asked for it."""

    def __init__(self, version: int, specs: list[protocol.TensorSpec], flat: torch.Tensor,
                 events: list, buffers: HostBuffers | None, started: float):
        self.version = version
        self.specs = specs
        self.flat = flat                   # uint8 [total_bytes]; back to ``buffers`` when unused
        self.events = events               # CUDA events after the copies (empty on the CPU)
        self.started = started
        self.manifest: protocol.WeightsAvailable | None = None
        self.chunks: list[memoryview] = []
        # Every chunk view is a view of this array, so it lives as long as any chunk (or a
        # zero-copy frame made from one) does; its finalizer returns the buffer.
        self.array = flat.numpy()
        if buffers is not None:
            weakref.finalize(self.array, buffers.give, flat)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


class WeightsServer:
    """Published versions (newest ``keep``) and the answer to every ``WeightChunkRequest``."""

    def __init__(self, chunk_bytes: int, kind: str = "full", keep: int = 2,
                 metadata: dict[str, Any] | None = None, buffers: HostBuffers | None = None,
                 lora: protocol.LoraSpec | None = None, metrics: Any = None, delta: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.chunk_bytes = chunk_bytes
        self.kind = kind
        self.keep = keep
        self.metrics = metrics          # LearnerMetrics: the egress bytes (None: not counted)
        self.metadata = dict(metadata or {})
        self.lora = lora                   # the adapter of a "lora" publish (its manifests' lora)
        self.buffers = buffers if buffers is not None else HostBuffers()
        self.delta = delta                 # answer a request that names a base with a delta
        self._versions: OrderedDict[int, Snapshot] = OrderedDict()
        # (base, version, index) -> the delta, or None where it is not smaller than the chunk;
        # kept while both versions are (install prunes it).
        self._deltas: dict[tuple[int, int, int], bytes | None] = {}
        self._delta_sizes = (0, 0)        # bytes sent for the newest pair's deltas made, their raw bytes
        self._delta_pair: tuple[int, int] | None = None

    # ---- the three steps --------------------------------------------------------------------
    def snapshot(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Snapshot:
        """Copy the tensors into a (reused) buffer: what the train loop waits for (thread-safe).

        Raises ``ValueError`` for a dtype that cannot be published. From CUDA the copies are only
        queued (see the module docstring); :meth:`prepare` waits for them.
        """
        started = time.monotonic()
        tensors, specs = layout(named_tensors)
        devices = {t.device for t in tensors if t.is_cuda}
        flat = self.buffers.take(sum(s.nbytes for s in specs), pin=bool(devices))
        copy_into(tensors, specs, flat, non_blocking=bool(devices))
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return Snapshot(version, specs, flat, events, self.buffers, started)

    def prepare(self, snap: Snapshot) -> Snapshot:
        """Chunks, checksums and the manifest of ``snap`` (a worker thread; touches no state)."""
        for event in snap.events:
            event.synchronize()
        chunks = split_chunks(memoryview(snap.array), self.chunk_bytes)
        sums = [chunk_checksum(c) for c in chunks]
        snap.manifest = protocol.WeightsAvailable(
            version=snap.version, kind=self.kind, tensors=snap.specs, total_bytes=snap.nbytes,
            chunk_bytes=self.chunk_bytes, num_chunks=len(chunks), checksum=combine_checksums(sums),
            chunk_checksums=sums, metadata=dict(self.metadata), lora=self.lora)
        snap.chunks = chunks
        return snap

    def install(self, snap: Snapshot) -> protocol.WeightsAvailable:
        """Serve ``snap`` from now on (versions only grow); forget versions beyond ``keep``."""
        if snap.manifest is None:
            raise ValueError(f"weights version {snap.version}: install before prepare")
        version = snap.version
        if self._versions and version <= next(reversed(self._versions)):
            raise ValueError(f"weights version {version} published after "
                             f"{next(reversed(self._versions))}: versions only grow")
        self._versions[version] = snap
        while len(self._versions) > self.keep:
            self._versions.popitem(last=False)
        for key in [k for k in self._deltas if k[0] not in self._versions or k[1] not in self._versions]:
            del self._deltas[key]
        return snap.manifest

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> protocol.WeightsAvailable:
        """The three steps in one call (on the loop; for tests and small models)."""
        return self.install(self.prepare(self.snapshot(version, named_tensors)))

    # ---- serving ----------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Versions being served, oldest first."""
        return list(self._versions)

    @property
    def latest(self) -> protocol.WeightsAvailable | None:
        return self._versions[next(reversed(self._versions))].manifest if self._versions else None

    def manifest(self, version: int) -> protocol.WeightsAvailable | None:
        snap = self._versions.get(version)
        return snap.manifest if snap is not None else None

    def chunk(self, version: int, index: int) -> protocol.WeightChunk | protocol.Error:
        """Chunk ``index`` of ``version``, or an ``Error`` saying why there is none.

        An unknown (or no longer kept) version and an index past the last chunk are answers, not
        protocol errors: a slow server asking for a version just dropped is normal, and it should
        hear why (it fetches the newest version instead).
        """
        snap = self._versions.get(version)
        if snap is None:
            kept = ", ".join(map(str, self._versions)) or "none yet"
            return protocol.Error(code="unknown_version",
                                  message=f"version {version} is not (or no longer) published; "
                                          f"serving: {kept}")
        n = len(snap.chunks)
        if not 0 <= index < n:
            return protocol.Error(code="bad_chunk",
                                  message=f"version {version} has chunks 0..{n - 1}, not {index}")
        return protocol.WeightChunk(version=version, index=index,
                                    checksum=snap.manifest.chunk_checksums[index], data=snap.chunks[index])

    def _delta_base(self, version: int, base: int) -> Snapshot | None:
        """The snapshot of ``base`` when a delta of ``version`` against it can be made: both
        kept, ``base`` older, the same tensors in the same chunks."""
        if not self.delta or not 0 <= base < version:
            return None
        snap, old = self._versions.get(version), self._versions.get(base)
        if snap is None or old is None or old.specs != snap.specs or len(old.chunks) != len(snap.chunks):
            return None
        return old

    async def delta_chunk(self, version: int, index: int, base: int) -> protocol.WeightChunk | None:
        """Chunk ``index`` of ``version`` as a delta against ``base``: made on a worker thread
        the first time, then kept while both versions are; None when there is none (no such
        base, or the delta is not smaller than the chunk)."""
        old = self._delta_base(version, base)
        if old is None or not 0 <= index < len(old.chunks):
            return None
        snap, key = self._versions[version], (base, version, index)
        if key in self._deltas:
            data = self._deltas[key]
        else:
            chunk = snap.chunks[index]
            data = await asyncio.to_thread(xor_delta, chunk, old.chunks[index])
            data = data if len(data) < chunk.nbytes else None
            if version in self._versions and base in self._versions:   # not dropped meanwhile
                self._deltas[key] = data
                if self._delta_pair is None or (version, base) > self._delta_pair:
                    self._delta_pair, self._delta_sizes = (version, base), (0, 0)
                if (version, base) == self._delta_pair:
                    sent, raw = self._delta_sizes
                    self._delta_sizes = (sent + (chunk.nbytes if data is None else len(data)), raw + chunk.nbytes)
        if data is None:
            return None
        return protocol.WeightChunk(version=version, index=index, base=base, encoding="xor-zstd",
                                    checksum=snap.manifest.chunk_checksums[index], data=data)

    def delta_ratio(self) -> float | None:
        """Bytes sent for the deltas of the newest version pair made so far over their raw
        bytes (None: no delta made yet): how small the next publish's deltas will likely be."""
        sent, raw = self._delta_sizes
        return sent / raw if raw else None

    async def handle(self, identity: bytes, msg: protocol.Message) -> protocol.Message:
        """The weights socket's handler: a ``WeightChunkRequest`` in, a chunk or an Error out.

        A request that names a ``base`` the learner still keeps gets a delta against it when
        that is smaller (made on a worker thread the first time, then kept)."""
        if not isinstance(msg, protocol.WeightChunkRequest):
            raise protocol.ProtocolError(f"weights socket: {type(msg).TYPE} is not a "
                                         f"{protocol.WeightChunkRequest.TYPE}")
        trace("learner.chunk")
        reply = await self.delta_chunk(msg.version, msg.index, msg.base) if msg.base >= 0 else None
        if reply is None:
            reply = self.chunk(msg.version, msg.index)
        if self.metrics is not None and isinstance(reply, protocol.WeightChunk):
            self.metrics.weights_egress_bytes.inc(len(reply.data))
            self.metrics.weights_chunks_served.labels(encoding="raw" if reply.encoding == "raw" else "delta").inc()
        return reply


INLINE_SNAPSHOT_BYTES = 16 << 20
"""A CPU snapshot up to this size is copied on the event loop (a few ms at most): handing it to a
worker thread and back costs more than the copy on a loaded machine. A larger one is copied in a
thread, so the sockets stay served. From CUDA the copies are only queued: always inline."""


def inline_snapshot(named_tensors: list[tuple[str, torch.Tensor]]) -> bool:
    return all(t.is_cuda for _, t in named_tensors) or (
        sum(t.numel() * t.element_size() for _, t in named_tensors) <= INLINE_SNAPSHOT_BYTES)


class Announcer(Protocol):
    """Where a new version's manifest goes (learner.serve.admission.Admission.announce)."""

    async def announce(self, manifest: protocol.WeightsAvailable) -> None: ...


class Publisher:
    """The train loop's side of publishing: ``await publish(...)`` returns once the snapshot is
    taken (the seconds it waited); preparing, installing and announcing run in one background
    task, in version order (see the module docstring for superseding).

    ``servers.announce(manifest)`` is awaited once per installed version (the :class:`Announcer`
    port: learner.serve.admission.Admission, which sends it to every server); once ``stopped()`` (the process
    is shutting down, its sockets closing) nothing more is installed or announced.
    ``metrics`` (learner.metrics.LearnerMetrics, optional) observes the train loop's wait and the
    seconds from the snapshot to the announcement, and counts the versions dropped unannounced,
    each also a ``weights_superseded`` event in ``log``. A failure
    of the background task (a prepare that raised) is raised by the next ``publish`` or
    ``drain``, so it stops the train loop as it did when publishing ran inside it.
    """

    def __init__(self, weights: WeightsServer, servers: Announcer, *,
                 stopped: Callable[[], bool] = lambda: False, metrics: Any = None,
                 log: Callable[..., None] = lambda event, **fields: None):
        self.weights = weights
        self.servers = servers
        self.stopped = stopped
        self.metrics, self.log = metrics, log
        self.superseded = 0
        self.preparing: int | None = None          # the version being prepared, if any
        self._waiting: Snapshot | None = None
        self._task: asyncio.Task | None = None
        self._failure: BaseException | None = None

    @property
    def waiting(self) -> int | None:
        """The version waiting for the background task, if any."""
        return self._waiting.version if self._waiting is not None else None

    def _superseded(self, version: int, by: int) -> None:
        if self.metrics is not None:
            self.metrics.publish_superseded.inc()
        self.log("weights_superseded", weights_version=version, by=by,
                 hint="steps finish faster than a publish is prepared; servers get the newer one")

    async def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
                      | Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> float:
        """Snapshot ``version`` and hand it to the background task; returns the seconds waited.

        ``named_tensors`` may be a callable (``Trainer.named_tensors``): then the wait includes
        collecting them (for LoRA, PEFT's adapter state dict is most of it)."""
        self._raise_failure()
        start = time.monotonic()
        named_tensors = list(named_tensors() if callable(named_tensors) else named_tensors)
        if inline_snapshot(named_tensors):
            snap = self.weights.snapshot(version, named_tensors)
        else:
            snap = await asyncio.to_thread(self.weights.snapshot, version, named_tensors)
        snap.started = start
        wait = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.publish_wait_seconds.observe(wait)
        old, self._waiting = self._waiting, snap
        if old is not None:
            self.superseded += 1
            self._superseded(old.version, version)
            del old                                 # its buffer goes back to the pool
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="publish")
        return wait

    async def drain(self) -> None:
        """Wait until every snapshot taken has been announced (or superseded)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        self._raise_failure()

    def cancel(self) -> None:
        """Stop the background task (a prepare already running in its thread finishes unseen)."""
        if self._task is not None:
            self._task.cancel()
        self._waiting = None

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    async def _run(self) -> None:
        while self._waiting is not None:
            snap, self._waiting = self._waiting, None
            self.preparing = snap.version
            try:
                await asyncio.to_thread(self.weights.prepare, snap)
                trace("learner.prepared")
                if self.stopped():
                    self._waiting = None
                    return
                manifest = self.weights.install(snap)
            except Exception as e:      # noqa: BLE001 - raised by the next publish() / drain()
                self._failure = e
                self._waiting = None
                return
            finally:
                self.preparing = None
            if self.metrics is not None:
                self.metrics.publish_seconds.observe(time.monotonic() - snap.started)
            del snap
            await self.servers.announce(manifest)
            trace("learner.announced")

