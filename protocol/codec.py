"""Frame layout and the codec: one function to serialize, one to deserialize.

A message is a list of ZeroMQ frames (the ROUTER identity frame, when present, is handled by the
socket layer, not here)::

    frame 0   header  msgpack map {"v": [major, minor], "type": str, "id": str, "ts": float}
    frame 1   body    msgpack map of the message's fields (see ``protocol.messages``)
    frame 2.. raw     bytes of ``Frame`` fields, in declaration order (weight chunks), zero-copy

The body is plain msgpack: arrays are maps ``{"dtype", "shape", "data": bin}`` with raw
little-endian bytes, so any msgpack library can read it. Nothing is ever pickled.

Compatibility: a peer with another *major* version is refused (``ProtocolError``); a newer minor
version may add optional fields, which older readers ignore, and a reader fills fields a sender
omitted with their defaults.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from protocol.errors import ProtocolError
from protocol.messages import MESSAGE_TYPES, Message
from protocol.schema import Frame

PROTOCOL_VERSION: tuple[int, int] = (1, 0)

MAX_HEADER_BYTES = 4096
MAX_BODY_BYTES = 256 << 20      # 256 MiB: a result with thousands of long samples still fits
MAX_FRAME_BYTES = 1 << 30       # one raw frame (a weight chunk) at most 1 GiB
MAX_FRAMES = 16

_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
_id_prefix = os.urandom(6).hex()
_id_counter = itertools.count()

_FRAME_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(name for name, kind in cls.FIELDS if isinstance(kind, Frame))
    for cls in MESSAGE_TYPES.values()
}


def new_message_id() -> str:
    """Process-unique, cheap id: random per-process prefix + counter."""
    return f"{_id_prefix}-{next(_id_counter)}"


def encode(message: Message, msg_id: str | None = None) -> list[bytes]:
    """Serialize ``message`` to ZeroMQ frames: [header, body, *raw frames]."""
    cls = type(message)
    if MESSAGE_TYPES.get(getattr(cls, "TYPE", None)) is not cls:
        raise ProtocolError(f"encode: {cls.__name__} is not a protocol message type")
    header = _packer.pack({"v": PROTOCOL_VERSION, "type": cls.TYPE,
                           "id": msg_id or new_message_id(), "ts": time.time()})
    try:
        body = _packer.pack(message.to_wire())
    except (TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(f"encode {cls.__name__}: {e}") from e
    frames = [header, body]
    for name in _FRAME_FIELDS[cls]:
        frames.append(getattr(message, name))
    return frames


def _unpack(data: Any, what: str, limit: int) -> Any:
    try:
        buf = memoryview(data)
    except TypeError:
        raise ProtocolError(f"{what}: frame is {type(data).__name__}, not bytes") from None
    if buf.nbytes > limit:
        raise ProtocolError(f"{what}: {buf.nbytes} bytes exceed the limit of {limit}")
    try:
        return msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError,
            UnicodeDecodeError) as e:
        raise ProtocolError(f"{what}: not valid msgpack ({type(e).__name__}: {e})") from None
    except Exception as e:  # msgpack raises a few others on hostile input (e.g. OutOfData)
        raise ProtocolError(f"{what}: not valid msgpack ({type(e).__name__})") from None


def decode_header(frames: Sequence[Any]) -> dict:
    """Validate and return the header (version, type, id, ts) without decoding the body."""
    if not isinstance(frames, (list, tuple)) or len(frames) < 2:
        raise ProtocolError("frames: expected at least [header, body]")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"frames: {len(frames)} frames exceed the limit of {MAX_FRAMES}")
    header = _unpack(frames[0], "header", MAX_HEADER_BYTES)
    if type(header) is not dict:
        raise ProtocolError("header: expected a map")
    v = header.get("v")
    if (type(v) is not list or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int):
        raise ProtocolError(f"header.v: expected [major, minor], got {v!r}")
    if v[0] != PROTOCOL_VERSION[0]:
        raise ProtocolError(
            f"header.v: peer speaks protocol {v[0]}.{v[1]}, this process speaks "
            f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}; major versions must match "
            "(upgrade the older side)")
    mtype = header.get("type")
    if type(mtype) is not str or mtype not in MESSAGE_TYPES:
        raise ProtocolError(f"header.type: unknown message type {mtype!r}")
    if type(header.get("id")) is not str:
        raise ProtocolError("header.id: expected a string")
    ts = header.get("ts")
    if type(ts) not in (float, int):
        raise ProtocolError("header.ts: expected a number")
    return header


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames produced by :func:`encode`; every bad input raises :class:`ProtocolError`."""
    header = decode_header(frames)
    cls = MESSAGE_TYPES[header["type"]]
    body = _unpack(frames[1], f"{cls.__name__} body", MAX_BODY_BYTES)
    try:
        msg = cls.from_wire(body)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise ProtocolError(f"{cls.__name__}: {type(e).__name__}: {e}") from None
    raw_names = _FRAME_FIELDS[cls]
    if len(frames) != 2 + len(raw_names):
        raise ProtocolError(f"{cls.__name__}: expected {2 + len(raw_names)} frames, got {len(frames)}")
    for name, data in zip(raw_names, frames[2:]):
        try:
            view = memoryview(data)
        except TypeError:
            raise ProtocolError(f"{cls.__name__}.{name}: frame is not bytes") from None
        if view.nbytes > MAX_FRAME_BYTES:
            raise ProtocolError(f"{cls.__name__}.{name}: {view.nbytes} bytes exceed {MAX_FRAME_BYTES}")
        setattr(msg, name, data)
    return msg


def message_id(frames: Sequence[Any]) -> str:
    """The header id of encoded frames, or "" if the header cannot be read."""
    try:
        return decode_header(frames)["id"]
    except ProtocolError:
        return ""
