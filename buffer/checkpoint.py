"""The buffer's checkpoint: :meth:`RolloutBuffer.state_dict` and ``load_state_dict`` as plain data.

A state holds the gate totals, the buffered samples (in protocol 2.0 wire form), the leases and
their payloads, the de-duplication windows, the counters and the staleness histogram. Arrays are
raw little-endian bytes as on the wire (msgpack- and torch.save-able), or with ``binary=False``
base64 strings tagged ``__b64__``, so the state is JSON-able as well; a ``protocol.Message``
payload (an ``Assignment``, say) is stored as its type and wire body.

Resume. Leases of the saved run are lost at a restart and reported by the next
:meth:`RolloutBuffer.expire` (capacity kept for reissue, or returned when out of attempts), so the
gate neither leaks nor double-counts. A load checks that the leases, the open groups and the
gate's buffered count agree.
"""

from __future__ import annotations

import base64
from collections import deque
from typing import TYPE_CHECKING, Any

from buffer.dedupe import RecentKeys
from buffer.groups import Group
from buffer.records import COUNTER_NAMES
from protocol import MESSAGE_TYPES, Message, Sample

if TYPE_CHECKING:
    from buffer.rollout_buffer import RolloutBuffer

STATE_FORMAT = 2         # 2: samples stored in protocol 2.0 wire form

_B64 = "__b64__"
_MSG = "__message__"


def state_dict(buf: RolloutBuffer, binary: bool = True) -> dict[str, Any]:
    """Everything ``buf`` needs to resume, as plain data (buffered samples included)."""
    groups = [g for g in buf._groups.values() if not g.ready] + list(buf._ready)
    return {
        "format": STATE_FORMAT,
        "version": buf._version,
        "batch_samples": buf.batch_samples,
        "group_size": buf.group_size,
        "max_staleness": buf.gate.max_staleness,
        "stale_policy": buf._policy,
        "gate": buf.gate.state_dict(),
        "leases": buf.leases.state_dict(lambda p: _pack_payload(p, binary)),
        "groups": [{"assignment_id": g.assignment_id, "size": g.size,
                    "samples": [_to_plain(s.to_wire(), binary) for s in g.slots if s is not None]}
                   for g in groups],
        "seen": [k for k, _ in buf._seen.items()],
        "closed": [[k, v] for k, v in buf._closed.items()],
        "counters": dict(buf._n),
        "staleness_histogram": [[k, v] for k, v in sorted(buf._hist.items())],
    }


def load_state_dict(buf: RolloutBuffer, state: dict[str, Any]) -> None:
    """Resume ``buf`` from :func:`state_dict`; it must have been built with the same group_size.

    η and the stale policy come from the checkpoint (they may have been changed at runtime; call
    the setters afterwards to override). Leases of the saved run are lost — their servers are gone
    or will reconnect — and the next ``expire`` reports them: for reissue (their capacity stays
    reserved, so the gate is exact), or, out of attempts, as failed with their capacity returned.
    Results that servers re-send for them in the meantime are accepted as usual.
    """
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"buffer state format {state.get('format')!r}, expected {STATE_FORMAT}")
    if state["group_size"] != buf.group_size:
        raise ValueError(f"checkpoint group_size {state['group_size']} != {buf.group_size}: "
                         "buffered groups cannot be re-cut")
    buf.gate.load_state_dict(state["gate"])
    buf._policy = buf._check_policy(state["stale_policy"])
    buf.leases.load_state_dict(state["leases"], _unpack_payload)
    buf._groups, buf._ready = {}, deque()
    buf._ready_samples = buf._pending = 0
    in_flight = 0
    for gd in state["groups"]:
        g = Group(gd["assignment_id"], int(gd["size"]))
        for w in gd["samples"]:
            s = Sample.from_wire(_from_plain(w), "buffer state sample")
            tv = s.token_versions
            g.fill(s.group_index, s, int(tv.min()) if len(tv) else -1)
        g.resolved = g.filled
        buf._groups[g.assignment_id] = g
        buf._pending += g.filled
        if g.filled == g.size:
            buf._set_ready(g)
        else:
            if g.assignment_id not in buf.leases:
                raise ValueError(f"buffer state: open group {g.assignment_id!r} has no lease")
            in_flight += g.size - g.filled
    if len(buf.leases) != len(buf._groups) - len(buf._ready):
        raise ValueError("buffer state: leases and open groups differ")
    if buf.gate.buffered != buf._pending:
        raise ValueError(f"buffer state: gate counts {buf.gate.buffered} buffered samples, "
                         f"the checkpoint holds {buf._pending}")
    buf.gate.in_flight = in_flight
    buf._seen = RecentKeys(buf._seen.capacity)
    buf._seen.update((k, None) for k in state["seen"])
    buf._closed = RecentKeys(buf._closed.capacity)
    buf._closed.update((k, v) for k, v in state["closed"])
    buf._n = dict.fromkeys(COUNTER_NAMES, 0)
    buf._n.update({k: int(v) for k, v in state["counters"].items() if k in buf._n})
    buf._hist = {int(k): int(v) for k, v in state["staleness_histogram"]}
    buf._version = int(state["version"])
    buf._started = True
    buf._swept = None


# -- plain data -----------------------------------------------------------------------------------

def _to_plain(x: Any, binary: bool) -> Any:
    """Wire form -> plain data: memoryviews become bytes (or base64 strings tagged ``__b64__``)."""
    t = type(x)
    if t is dict:
        return {k: _to_plain(v, binary) for k, v in x.items()}
    if t is list or t is tuple:
        return [_to_plain(v, binary) for v in x]
    if t is memoryview or t is bytes or t is bytearray:
        b = bytes(x)
        return b if binary else {_B64: base64.b64encode(b).decode("ascii")}
    if x is None or t in (str, int, float, bool):
        return x
    raise TypeError(f"not plain data: {t.__name__} (lease payloads must be plain data or a "
                    "protocol.Message)")


def _from_plain(x: Any) -> Any:
    t = type(x)
    if t is dict:
        if len(x) == 1 and _B64 in x:
            return base64.b64decode(x[_B64])
        return {k: _from_plain(v) for k, v in x.items()}
    if t is list:
        return [_from_plain(v) for v in x]
    return x


def _pack_payload(payload: Any, binary: bool) -> Any:
    if isinstance(payload, Message):
        return {_MSG: payload.TYPE, "body": _to_plain(payload.to_wire(), binary)}
    return _to_plain(payload, binary)


def _unpack_payload(p: Any) -> Any:
    if type(p) is dict and _MSG in p:
        return MESSAGE_TYPES[p[_MSG]].from_wire(_from_plain(p["body"]))
    return _from_plain(p)
