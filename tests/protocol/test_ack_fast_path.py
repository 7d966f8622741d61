"""Ack's hand-written ``to_wire`` / ``from_wire`` (the learner sends one per result, every server
decodes each): the same wire form as the reference path, and never an Ack the checked path
refuses."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import plain_values

from protocol import ACK_STATUSES, Ack, ProtocolError, decode, encode
from protocol.schema import MAX_LIST_ITEMS, MAX_STR_CHARS

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def wire(body) -> list:
    return msgpack.unpackb(msgpack.packb(body))          # as it would arrive


def good() -> list:
    return wire([["run-a1/0", "run-a1/1", "run-a2/0"], ["accepted", "duplicate", "accepted"]])


BAD_BODIES = {
    "status unknown": lambda b: b[1].__setitem__(1, "lost"),
    "status bytes": lambda b: b[1].__setitem__(0, b"accepted"),
    "status int": lambda b: b[1].__setitem__(0, 1),
    "status list (unhashable)": lambda b: b[1].__setitem__(0, ["accepted"]),
    "status map (unhashable)": lambda b: b[1].__setitem__(2, {"accepted": 1}),
    "status None": lambda b: b[1].__setitem__(0, None),
    "id int": lambda b: b[0].__setitem__(0, 7),
    "id bytes": lambda b: b[0].__setitem__(2, b"run-a2/0"),
    "id list": lambda b: b[0].__setitem__(1, ["x"]),
    "id None": lambda b: b[0].__setitem__(1, None),
    "id oversize": lambda b: b[0].__setitem__(0, "x" * (MAX_STR_CHARS + 1)),
    "lengths differ": lambda b: b[1].pop(),
    "ids not a list": lambda b: b.__setitem__(0, "run-a1/0"),
    "statuses a map": lambda b: b.__setitem__(1, {"accepted": 3}),
    "statuses missing": lambda b: b.pop(),
}


@pytest.mark.parametrize("mutate", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
def test_fast_path_refuses_what_the_checked_path_refuses(mutate):
    body = good()
    mutate(body)
    body = wire(body)
    with pytest.raises(ProtocolError):
        Ack.from_wire_checked(body)
    with pytest.raises(ProtocolError):
        Ack.from_wire(body)


def test_too_many_ids_are_refused_on_both_paths():
    n = MAX_LIST_ITEMS + 1
    body = [[f"a/{i}" for i in range(n)], ["accepted"] * n]
    with pytest.raises(ProtocolError, match="exceed"):
        Ack.from_wire(body)


def test_hot_paths_are_taken_and_round_trip(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("slow path taken")

    ack = Ack(sample_ids=["r-a1/0", "r-a1/1", ""], statuses=["accepted", "stale", "invalid"])
    monkeypatch.setattr(Ack, "to_wire_checked", refuse)
    monkeypatch.setattr(Ack, "from_wire_checked", classmethod(refuse))
    got = decode(encode(ack))
    assert got == ack and type(got.sample_ids) is list and type(got.statuses) is list
    empty = decode(encode(Ack(sample_ids=[], statuses=[])))
    assert empty.sample_ids == [] and empty.statuses == []


def test_tuples_go_the_checked_way_to_the_same_bytes():
    a = Ack(sample_ids=("x/0", "x/1"), statuses=("accepted", "duplicate"))
    b = Ack(sample_ids=["x/0", "x/1"], statuses=["accepted", "duplicate"])
    assert encode(a, "id")[1] == encode(b, "id")[1]


@FUZZ
@given(n=st.integers(0, 4), data=st.data())
def test_fast_and_checked_paths_agree_on_random_values(n, data):
    ids = data.draw(st.lists(st.text(max_size=8) | plain_values, min_size=n, max_size=n))
    statuses = data.draw(st.lists(st.sampled_from(ACK_STATUSES) | plain_values,
                                  min_size=data.draw(st.sampled_from([n, n, n + 1, max(n - 1, 0)])),
                                  max_size=n + 1))
    body = wire(data.draw(st.sampled_from([[ids, statuses], [ids, statuses, "newer field"],
                                           [ids], [statuses, ids]])))
    try:
        checked = Ack.from_wire_checked(body)
    except ProtocolError:
        with pytest.raises(ProtocolError):
            Ack.from_wire(body)
        return
    assert Ack.from_wire(body) == checked
