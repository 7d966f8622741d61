"""Plain data for the buffer's checkpoint (:meth:`buffer.rollout_buffer.RolloutBuffer.state_dict`).

Samples are kept in their protocol wire form. Arrays are raw little-endian bytes as on the wire
(msgpack- and torch.save-able), or with ``binary=False`` base64 strings tagged ``__b64__``, so
the state is JSON-able as well; a ``protocol.Message`` payload (an ``Assignment``, say) is stored
as its type and wire body.
"""

from __future__ import annotations

import base64
from typing import Any

from protocol import MESSAGE_TYPES, Message

__all__ = ["from_plain", "pack_payload", "to_plain", "unpack_payload"]

_B64 = "__b64__"
_MSG = "__message__"


def to_plain(x: Any, binary: bool) -> Any:
    """Wire form -> plain data: memoryviews become bytes (or base64 strings tagged ``__b64__``)."""
    t = type(x)
    if t is dict:
        return {k: to_plain(v, binary) for k, v in x.items()}
    if t is list or t is tuple:
        return [to_plain(v, binary) for v in x]
    if t is memoryview or t is bytes or t is bytearray:
        b = bytes(x)
        return b if binary else {_B64: base64.b64encode(b).decode("ascii")}
    if x is None or t in (str, int, float, bool):
        return x
    raise TypeError(f"not plain data: {t.__name__} (lease payloads must be plain data or a "
                    "protocol.Message)")


def from_plain(x: Any) -> Any:
    t = type(x)
    if t is dict:
        if len(x) == 1 and _B64 in x:
            return base64.b64decode(x[_B64])
        return {k: from_plain(v) for k, v in x.items()}
    if t is list:
        return [from_plain(v) for v in x]
    return x


def pack_payload(payload: Any, binary: bool) -> Any:
    if isinstance(payload, Message):
        return {_MSG: payload.TYPE, "body": to_plain(payload.to_wire(), binary)}
    return to_plain(payload, binary)


def unpack_payload(p: Any) -> Any:
    if type(p) is dict and _MSG in p:
        return MESSAGE_TYPES[p[_MSG]].from_wire(from_plain(p["body"]))
    return from_plain(p)
