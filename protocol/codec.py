"""Frame layout and the codec: one function to serialize, one to deserialize.

A message is a list of ZeroMQ frames (the ROUTER identity frame, when present, is handled by the
socket layer, not here)::

    frame 0   header  msgpack map {"v": [major, minor], "type": str, "id": str, "ts": float}
    frame 1   body    msgpack map of the message's fields (see ``protocol.messages``)
    frame 2.. raw     bytes of ``Frame`` fields, in declaration order (weight chunks), zero-copy

The body is plain msgpack: arrays are ``[dtype, shape, data]`` triples (``["<i4", [n], bin]``)
with raw little-endian bytes, so any msgpack library can read it. Nothing is ever pickled.

Compatibility: a peer with another *major* version is refused (``ProtocolError``); a newer minor
version may add optional fields, which older readers ignore, and a reader fills fields a sender
omitted with their defaults.

Speed: the header is assembled from a per-type precomputed prefix (it is byte-for-byte what
``msgpack.packb`` writes for the map above), one module-level ``msgpack.Packer`` is reused, and
``Sample``/``RolloutResult`` have hand-written ``to_wire``/``from_wire``
(tests/bench/bench_protocol.py measures it against bare msgpack). The shared packer is safe under
the GIL: packing our plain values runs no Python code, so one ``pack`` call cannot interleave
with another.
"""

from __future__ import annotations

import itertools
import os
import struct
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import msgpack

from protocol.errors import ProtocolError
from protocol.messages import MESSAGE_TYPES, Message
from protocol.schema import Frame, Struct, StructList, frame_fields

PROTOCOL_VERSION: tuple[int, int] = (1, 0)

MAX_HEADER_BYTES = 4096
MAX_BODY_BYTES = 256 << 20      # 256 MiB: a result with thousands of long samples still fits
MAX_FRAME_BYTES = 1 << 30       # one raw frame (a weight chunk) at most 1 GiB
MAX_FRAMES = 16

_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
_pack = _packer.pack
_unpackb = msgpack.unpackb      # defaults: raw=False, strict_map_key=True, use_list=True
_time = time.time
_TS_KEY_AND_FLOAT64 = b"\xa2ts\xcb"        # fixstr "ts", then a big-endian float64 follows
_float64 = struct.Struct(">d").pack
_id_prefix = os.urandom(6).hex()
_id_counter = itertools.count()

_FRAME_FIELDS: dict[type, tuple[str, ...]] = {cls: frame_fields(cls) for cls in MESSAGE_TYPES.values()}


def _header_prefix(type_name: str) -> bytes:
    """``{"v": [major, minor], "type": type_name, "id": `` (the rest is appended per message)."""
    return (b"\x84" + _pack("v") + _pack(list(PROTOCOL_VERSION)) + _pack("type") + _pack(type_name)
            + _pack("id"))


_HEADER_PREFIX: dict[type, bytes] = {cls: _header_prefix(name) for name, cls in MESSAGE_TYPES.items()}
_BODY_NAMES: dict[type, str] = {cls: f"{cls.__name__} body" for cls in MESSAGE_TYPES.values()}
_TYPE_NAMES = frozenset(MESSAGE_TYPES)
_MAJOR = PROTOCOL_VERSION[0]


def new_message_id() -> str:
    """Process-unique, cheap id: random per-process prefix + counter."""
    return f"{_id_prefix}-{next(_id_counter)}"


def encode(message: Message, msg_id: str | None = None) -> list[bytes]:
    """Serialize ``message`` to ZeroMQ frames: [header, body, *raw frames]."""
    cls = type(message)
    prefix = _HEADER_PREFIX.get(cls)
    if prefix is None:
        raise ProtocolError(f"encode: {cls.__name__} is not a protocol message type")
    if not msg_id:
        msg_id = new_message_id()
    elif type(msg_id) is not str:
        raise ProtocolError(f"encode: msg_id must be a string, got {type(msg_id).__name__}")
    header = b"".join((prefix, _pack(msg_id), _TS_KEY_AND_FLOAT64, _float64(_time())))
    try:
        body = _pack(message.to_wire())
    except Exception:       # redo it the slow way, for a conversion or an error naming the field
        body = _encode_checked(message)
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(f"encode {cls.__name__}: body of {len(body)} bytes exceeds the limit "
                            f"of {MAX_BODY_BYTES}")
    frames = [header, body]
    for name in _FRAME_FIELDS[cls]:
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
        return _unpackb(data)
    except Exception as e:  # ExtraData, FormatError, StackError, ValueError, UnicodeDecodeError ...
        raise ProtocolError(f"{what}: not valid msgpack ({type(e).__name__}: {e})") from None


def decode_header(frames: Sequence[Any]) -> dict:
    """Validate and return the header (version, type, id, ts) without decoding the body."""
    if type(frames) is not list and not isinstance(frames, (list, tuple)):
        raise ProtocolError(f"frames: expected a list of frames, got {type(frames).__name__}")
    if not 2 <= len(frames) <= MAX_FRAMES:
        if len(frames) < 2:
            raise ProtocolError("frames: expected at least [header, body]")
        raise ProtocolError(f"frames: {len(frames)} frames exceed the limit of {MAX_FRAMES}")
    header = _unpack(frames[0], "header", MAX_HEADER_BYTES)
    if type(header) is dict:
        v, mtype = header.get("v"), header.get("type")
        ts = header.get("ts")
        if (type(v) is list and len(v) == 2 and v[0] == _MAJOR and type(v[0]) is int
                and type(v[1]) is int and type(mtype) is str and mtype in _TYPE_NAMES
                and type(header.get("id")) is str and (type(ts) is float or type(ts) is int)):
            return header
    _raise_header_error(header)


def _raise_header_error(header: Any) -> NoReturn:
    if type(header) is not dict:
        raise ProtocolError(f"header: expected a map, got {type(header).__name__}")
    v = header.get("v")
    if type(v) is not list or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int:
        raise ProtocolError(f"header.v: expected [major, minor], got {v!r:.100}")
    if v[0] != _MAJOR:
        raise ProtocolError(
            f"header.v: peer speaks protocol {v[0]}.{v[1]}, this process speaks "
            f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}; major versions must match "
            "(upgrade the older side)")
    mtype = header.get("type")
    if type(mtype) is not str or mtype not in MESSAGE_TYPES:
        raise ProtocolError(f"header.type: unknown message type {mtype!r:.100}")
    if type(header.get("id")) is not str:
        raise ProtocolError("header.id: expected a string")
    raise ProtocolError("header.ts: expected a number")


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames produced by :func:`encode`; every bad input raises :class:`ProtocolError`."""
    cls = MESSAGE_TYPES[decode_header(frames)["type"]]
    raw_names = _FRAME_FIELDS[cls]
    if len(frames) != 2 + len(raw_names):
        raise ProtocolError(f"{cls.__name__}: expected {2 + len(raw_names)} frames, got {len(frames)}")
    body = _unpack(frames[1], _BODY_NAMES[cls], MAX_BODY_BYTES)
    try:
        msg = cls.from_wire(body)
    except ProtocolError:
        raise
    except Exception as e:  # a validation bug must still surface as bad input, not a crash
        raise ProtocolError(f"{cls.__name__}: {type(e).__name__}: {e}") from None
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
    return msg


def message_id(frames: Sequence[Any]) -> str:
    """The header id of encoded frames, or "" if the header cannot be read."""
    try:
        return decode_header(frames)["id"]
    except ProtocolError:
        return ""
