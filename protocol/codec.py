"""Frame layout and the codec: one function to serialize, one to deserialize.

A message is a list of ZeroMQ frames (the ROUTER identity frame, when present, is handled by the
socket layer, not here); every frame is plain msgpack, nothing is ever pickled::

    frame 0   header  msgpack array [major, minor, type, id, ts]
                        major, minor  int    PROTOCOL_VERSION of the sender
                        type          str    message type, a key of MESSAGE_TYPES ("rollout_result")
                        id            str    message id (what an Error's ref_id points at)
                        ts            float  sender's time.time() (an int is accepted)
    frame 1   body    msgpack array of the message's field values in ``FIELDS`` order
                      (``protocol.messages``; ``protocol.schema.wire_field_names(cls)`` lists
                      them); a nested record (a result's samples, a manifest's tensors) is such an
                      array too; free-form maps (metadata, reward_parts, timing, ...) are maps
    frame 2.. raw     bytes of ``Frame`` fields, in declaration order (weight chunks), zero-copy

Arrays (``Array`` fields: token ids, log-probs, versions) are msgpack bin holding the raw
little-endian bytes of a 1-D array. Their dtypes travel with them: every sample carries
``array_dtypes``, the numpy dtype strings of its four arrays in field order
(``"<i4,<i4,<f4,<i4"``), which a receiver checks (another declaration is refused, never
misread); the shape of a 1-D array is its byte length / item size, checked against the other
arrays of the sample. (An ``Assignment``'s prompt ids are ``<i4`` by the schema.) A
``RolloutResult`` body, for example, is ``[server_id, [sample, ...]]`` and each sample is ::

    [sample_id: str, assignment_id: str, group_index: int, group_size: int,
     prompt_token_ids: bin <i4, completion_token_ids: bin <i4, behavior_logprobs: bin <f4,
     token_versions: bin <i4, reward: float, reward_parts: {str: float}, finish_reason: str,
     timing: {str: float}, completion_text: str, failed: str | nil, metadata: {str: any},
     array_dtypes: str, sampling_temperature: float | nil]

so ``msgpack.unpackb`` reads any frame, ``dict(zip(wire_field_names(cls), body))`` names the
values, and ``np.frombuffer(sample[5], "<i4")`` is the completion.

Why arrays of values, raw bytes and one dtype string per sample rather than maps and protocol
1's per-array ``[dtype, [n], data]`` triples: the keys and the triples each cost about a fifth
of a bare msgpack round trip of the message in msgpack work alone (strings and lists to build,
pack, unpack, hash and free), the triples as much again to build and check.
tests/bench/bench_protocol.py measures the layouts (its ``layout_*`` rows).

Compatibility: the major version is the first header value, in every version of this layout; a
peer with another *major* version is refused with a ``ProtocolError`` that names both versions
(a protocol-1 header, a map, is recognised for that message). Within a major version fields are
never reordered, removed or retyped: a newer *minor* version may only append fields, at the end
of the header, of a body or of a nested record. Readers ignore values beyond the fields they
know, and give fields missing at the end (an older sender) their defaults; a missing field
without a default is an error.

Speed: the header is a per-type precomputed prefix plus the packed id and timestamp
(byte-for-byte what ``msgpack.packb`` writes for the array above); one module-level
``msgpack.Packer`` is reused; ``decode`` has a fast path for the usual [header, body] of bytes
that checks the header inline and calls the type's ``from_wire`` directly, and everything else
goes the general way, which checks in order and names what is wrong; ``Sample`` and
``RolloutResult`` have hand-written ``to_wire``/``from_wire``. The shared packer is safe under
the GIL: packing our plain values runs no Python code, so one ``pack`` call cannot interleave
with another.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import msgpack

from protocol.errors import ProtocolError
from protocol.messages import MESSAGE_TYPES, Message
from protocol.schema import (
    MAX_LIST_ITEMS,
    MAX_MAP_ITEMS,
    MAX_STR_CHARS,
    Frame,
    Struct,
    StructList,
    frame_fields,
)

PROTOCOL_VERSION: tuple[int, int] = (3, 8)

MAX_HEADER_BYTES = 4096
MAX_BODY_BYTES = 256 << 20      # 256 MiB: a result with thousands of long samples still fits
MAX_FRAME_BYTES = 1 << 30       # one raw frame (a weight chunk) at most 1 GiB
MAX_FRAMES = 16

_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
_pack = _packer.pack
_unpackb = msgpack.unpackb      # defaults: raw=False, strict_map_key=True, use_list=True
# Untrusted input: msgpack checks a declared length only against the input's size by default,
# so a 64 MiB frame could declare a 64 Mi-element array (half a GiB of pointers before the first
# element is read). Inputs larger than _SMALL_BYTES are unpacked with explicit limits, twice
# what the schema accepts (so the schema's own check, which names the field, speaks first for a
# value just over, while a length far beyond is refused before anything is allocated for it);
# ext types are never used. Smaller inputs keep the defaults (limits = their size, at most
# _SMALL_BYTES) and skip the keyword parsing, a sixth of a small body's unpack time.
_SMALL_BYTES = MAX_LIST_ITEMS
_unpackb_limited = functools.partial(
    msgpack.unpackb, max_str_len=8 * MAX_STR_CHARS, max_bin_len=MAX_BODY_BYTES,
    max_array_len=2 * MAX_LIST_ITEMS, max_map_len=2 * MAX_MAP_ITEMS, max_ext_len=0)
_time = time.time
_FLOAT64 = 0xCB                 # msgpack float 64: the marker, then a big-endian double
_float64 = struct.Struct(">Bd").pack
_id_prefix = os.urandom(6).hex()
_id_counter = itertools.count()
_MAJOR, _MINOR = PROTOCOL_VERSION

_FRAME_FIELDS: dict[type, tuple[str, ...]] = {cls: frame_fields(cls) for cls in MESSAGE_TYPES.values()}
_N_FRAMES: dict[type, int] = {cls: 2 + len(names) for cls, names in _FRAME_FIELDS.items()}
# header up to the id: fixarray of 5, major, minor, type
_HEADER_PREFIX: dict[type, bytes] = {
    cls: b"\x95" + _pack(_MAJOR) + _pack(_MINOR) + _pack(name) for name, cls in MESSAGE_TYPES.items()}
# type name -> bound ``from_wire`` of the types whose message is [header, body] only
_BODY_ONLY_DECODERS: dict[str, Any] = {
    name: cls.from_wire for name, cls in MESSAGE_TYPES.items() if not _FRAME_FIELDS[cls]}
_ENCODE_INFO: dict[type, tuple[bytes, tuple[str, ...]]] = {
    cls: (_HEADER_PREFIX[cls], _FRAME_FIELDS[cls]) for cls in MESSAGE_TYPES.values()}
_NOT_A_MESSAGE = (None, ())
_BODY_NAMES: dict[type, str] = {cls: f"{cls.__name__} body" for cls in MESSAGE_TYPES.values()}


def new_message_id() -> str:
    """Process-unique, cheap id: random per-process prefix + counter."""
    return f"{_id_prefix}-{next(_id_counter)}"


def encode(message: Message, msg_id: str | None = None) -> list[bytes]:
    """Serialize ``message`` to ZeroMQ frames: [header, body, *raw frames]."""
    cls = type(message)
    prefix, frame_names = _ENCODE_INFO.get(cls, _NOT_A_MESSAGE)
    if prefix is None:
        raise ProtocolError(f"encode: {cls.__name__} is not a protocol message type")
    if not msg_id:
        msg_id = f"{_id_prefix}-{next(_id_counter)}"
    elif type(msg_id) is not str:
        raise ProtocolError(f"encode: msg_id must be a string, got {type(msg_id).__name__}")
    header = prefix + _pack(msg_id) + _float64(_FLOAT64, _time())
    try:
        body = _pack(message.to_wire())
    except Exception:       # redo it the slow way, for a conversion or an error naming the field
        body = _encode_checked(message)
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(f"encode {cls.__name__}: body of {len(body)} bytes exceeds the limit "
                            f"of {MAX_BODY_BYTES}")
    if not frame_names:
        return [header, body]
    frames = [header, body]
    for name in frame_names:
        data = getattr(message, name)
        try:
            nbytes = memoryview(data).nbytes
        except TypeError:
            raise ProtocolError(f"encode {cls.__name__}.{name}: expected bytes, got "
                                f"{type(data).__name__}") from None
        if nbytes > MAX_FRAME_BYTES:
            raise ProtocolError(f"encode {cls.__name__}.{name}: {nbytes} bytes exceed {MAX_FRAME_BYTES}")
        frames.append(data)
    return frames


def _encode_checked(message: Message) -> bytes:
    """Slow path of ``encode``: the reference ``to_wire_checked``; on failure, name the field."""
    wire = message.to_wire_checked()    # raises ProtocolError naming a field it cannot convert
    try:
        return _pack(wire)
    except Exception as e:
        raise _unpackable_field(message, type(message).__name__) or ProtocolError(
            f"encode {type(message).__name__}: {type(e).__name__}: {e}") from None


def _unpackable_field(obj: Struct, where: str) -> ProtocolError | None:
    """The first field (depth first) whose value msgpack cannot pack, as an error naming it."""
    for name, kind in type(obj).FIELDS:
        if isinstance(kind, Frame):
            continue
        value = getattr(obj, name)
        if isinstance(kind, StructList):
            for i, item in enumerate(value):
                error = _unpackable_field(item, f"{where}.{name}[{i}]")
                if error is not None:
                    return error
            continue
        try:
            _pack(kind.pack(value))
        except Exception as e:
            return ProtocolError(f"{where}.{name}: cannot be encoded ({type(e).__name__}: {e})")
    return None


def _unpack(data: Any, what: str, limit: int) -> Any:
    if type(data) is bytes:
        if len(data) > limit:
            raise ProtocolError(f"{what}: {len(data)} bytes exceed the limit of {limit}")
    else:
        try:
            nbytes = memoryview(data).nbytes
        except TypeError:
            raise ProtocolError(f"{what}: frame is {type(data).__name__}, not bytes") from None
        if nbytes > limit:
            raise ProtocolError(f"{what}: {nbytes} bytes exceed the limit of {limit}")
    try:
        return _unpackb_limited(data)
    except Exception as e:  # ExtraData, FormatError, StackError, ValueError, UnicodeDecodeError ...
        raise ProtocolError(f"{what}: not valid msgpack ({type(e).__name__}: {e})") from None


def _header(frames: Sequence[Any]) -> tuple[type[Message], list]:
    """Check the frame list and the header; return the message class and the header array."""
    if type(frames) is not list and not isinstance(frames, (list, tuple)):
        raise ProtocolError(f"frames: expected a list of frames, got {type(frames).__name__}")
    if not 2 <= len(frames) <= MAX_FRAMES:
        if len(frames) < 2:
            raise ProtocolError("frames: expected at least [header, body]")
        raise ProtocolError(f"frames: {len(frames)} frames exceed the limit of {MAX_FRAMES}")
    data = frames[0]
    if type(data) is bytes and len(data) <= MAX_HEADER_BYTES:
        try:
            header = _unpackb(data)
        except Exception:
            header = _unpack(data, "header", MAX_HEADER_BYTES)    # raises, naming the frame
    else:
        header = _unpack(data, "header", MAX_HEADER_BYTES)
    if type(header) is list and len(header) >= 5:
        major, minor, mtype, mid, ts = header[0], header[1], header[2], header[3], header[4]
        if (major == _MAJOR and type(major) is int and type(minor) is int and type(mtype) is str
                and type(mid) is str and (type(ts) is float or type(ts) is int)):
            cls = MESSAGE_TYPES.get(mtype)
            if cls is not None:
                return cls, header
    _raise_header_error(header)


def decode_header(frames: Sequence[Any]) -> dict:
    """Validate and return the header as ``{"v": [major, minor], "type", "id", "ts"}`` without
    decoding the body. Values a newer minor version appended to the header are not returned."""
    header = _header(frames)[1]
    return {"v": header[:2], "type": header[2], "id": header[3], "ts": header[4]}


def _raise_header_error(header: Any) -> NoReturn:
    if type(header) is dict and "v" in header:     # a protocol-1 header: {"v": [major, minor], ...}
        v = header["v"]
        if (type(v) is list and len(v) == 2 and type(v[0]) is int and type(v[1]) is int
                and v[0] != _MAJOR):
            _raise_version_error(v[0], v[1])
    if type(header) is not list:
        raise ProtocolError(f"header: expected an array [major, minor, type, id, ts], got "
                            f"{type(header).__name__}")
    if len(header) < 5:
        raise ProtocolError(f"header: {len(header)} values, expected an array "
                            "[major, minor, type, id, ts]")
    major, minor, mtype = header[0], header[1], header[2]
    if type(major) is not int or type(minor) is not int:
        raise ProtocolError(f"header.v: expected integers major, minor, got {major!r:.40}, "
                            f"{minor!r:.40}")
    if major != _MAJOR:
        _raise_version_error(major, minor)
    if type(mtype) is not str or mtype not in MESSAGE_TYPES:
        raise ProtocolError(f"header.type: unknown message type {mtype!r:.100}")
    if type(header[3]) is not str:
        raise ProtocolError("header.id: expected a string")
    raise ProtocolError("header.ts: expected a number")


def _raise_version_error(major: int, minor: int) -> NoReturn:
    raise ProtocolError(
        f"header.v: peer speaks protocol {major}.{minor}, this process speaks "
        f"{_MAJOR}.{_MINOR}; major versions must match (upgrade the older side)")


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames produced by :func:`encode`; every bad input raises :class:`ProtocolError`."""
    # Fast path: [header, body] as bytes (the body may be a memoryview) within the limits, a
    # header of this exact minor version's shape, a message type without raw frames. Anything
    # else (including every error) goes the general way, which checks in order and names what
    # is wrong.
    if type(frames) is list and len(frames) == 2:
        head, data = frames
        # The body may be a memoryview (a receiver's view of the buffer libzmq received it
        # into, learner.serve.router): msgpack reads it in place.
        size = len(data) if type(data) is bytes else data.nbytes if type(data) is memoryview else -1
        if type(head) is bytes and len(head) <= MAX_HEADER_BYTES and 0 <= size <= MAX_BODY_BYTES:
            try:
                header = _unpackb(head)
                body = _unpackb(data) if size <= _SMALL_BYTES else _unpackb_limited(data)
            except Exception:
                pass
            else:
                if type(header) is list and len(header) == 5:
                    major, minor, mtype, mid, ts = header
                    if (major == _MAJOR and type(major) is int and type(minor) is int
                            and type(mtype) is str and type(mid) is str
                            and (type(ts) is float or type(ts) is int)):
                        from_wire = _BODY_ONLY_DECODERS.get(mtype)
                        if from_wire is not None:
                            try:
                                return from_wire(body)
                            except ProtocolError:
                                raise
                            except Exception as e:  # a validation bug must surface as bad input
                                raise ProtocolError(f"{MESSAGE_TYPES[mtype].__name__}: "
                                                    f"{type(e).__name__}: {e}") from None
    return _decode(frames)


def _decode(frames: Sequence[Any]) -> Message:
    """``decode``, every check in order."""
    cls = _header(frames)[0]
    if len(frames) != _N_FRAMES[cls]:
        raise ProtocolError(f"{cls.__name__}: expected {_N_FRAMES[cls]} frames, got {len(frames)}")
    msg = _from_wire(cls, _unpack(frames[1], _BODY_NAMES[cls], MAX_BODY_BYTES))
    raw_names = _FRAME_FIELDS[cls]
    if raw_names:
        _attach_frames(msg, cls, raw_names, frames)
    return msg


def _from_wire(cls: type[Message], body: Any) -> Message:
    try:
        return cls.from_wire(body)
    except ProtocolError:
        raise
    except Exception as e:  # a validation bug must still surface as bad input, not a crash
        raise ProtocolError(f"{cls.__name__}: {type(e).__name__}: {e}") from None


def _attach_frames(msg: Message, cls: type, raw_names: tuple[str, ...], frames: Sequence[Any]) -> None:
    for name, data in zip(raw_names, frames[2:]):
        if type(data) is bytes:
            nbytes = len(data)
        else:   # zmq.Frame (copy=False), bytearray, memoryview: keep a zero-copy view
            try:
                data = memoryview(data)
            except TypeError:
                raise ProtocolError(f"{cls.__name__}.{name}: frame is {type(data).__name__}, "
                                    "not bytes") from None
            nbytes = data.nbytes
        if nbytes > MAX_FRAME_BYTES:
            raise ProtocolError(f"{cls.__name__}.{name}: {nbytes} bytes exceed {MAX_FRAME_BYTES}")
        setattr(msg, name, data)


def message_id(frames: Sequence[Any]) -> str:
    """The header id of encoded frames, or "" if the header cannot be read."""
    try:
        return _header(frames)[1][3]
    except ProtocolError:
        return ""
