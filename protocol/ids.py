"""Identifier formats shared by both processes.

A sample id is ``"<assignment_id>/<group_index>"``: the learner's buffer de-duplicates by it, a
server matches acks to its pending results by it. Built and parsed only here.
"""

from __future__ import annotations

from protocol.errors import ProtocolError

SAMPLE_ID_SEPARATOR = "/"


def sample_id(assignment_id: str, group_index: int) -> str:
    """The id of completion ``group_index`` of assignment ``assignment_id``."""
    return f"{assignment_id}{SAMPLE_ID_SEPARATOR}{int(group_index)}"


def parse_sample_id(value: str) -> tuple[str, int]:
    """``(assignment_id, group_index)`` of a sample id; ``ProtocolError`` if it is not one."""
    assignment_id, sep, index = value.rpartition(SAMPLE_ID_SEPARATOR)
    if not sep or not assignment_id or not index.isdigit():
        raise ProtocolError(f"sample id {value!r} is not '<assignment_id>/<group_index>'")
    return assignment_id, int(index)
