"""StalenessGate: the capacity rule, with the arithmetic written out."""

from __future__ import annotations

import json

import pytest

from buffer import StalenessGate


def test_fresh_gate_allows_eta_plus_one_batches():
    gate = StalenessGate(batch_samples=32, max_staleness=1)
    # (0 + 1 + 1) * 32 - (0 + 0) = 64
    assert gate.capacity(0) == 64
    gate = StalenessGate(batch_samples=32, max_staleness=0)
    # (0 + 0 + 1) * 32 - 0 = 32: strictly one batch ahead
    assert gate.capacity(0) == 32


def test_worked_example_of_the_module_docstring():
    gate = StalenessGate(batch_samples=32, max_staleness=1)
    gate.on_issued(64)
    # (0 + 1 + 1) * 32 - (0 + 64) = 0
    assert gate.capacity(0) == 0
    gate.on_accepted(32)
    # accepted 32 + in flight 32: (0 + 1 + 1) * 32 - (32 + 32) = 0
    assert gate.capacity(0) == 0
    gate.on_consumed(32)
    # batch 0 trained, v = 1; trained samples still count: (1 + 1 + 1) * 32 - (32 + 32) = 32
    assert gate.capacity(1) == 32
    gate.on_failed(8)
    # 8 in flight came back stale: (1 + 1 + 1) * 32 - (32 + 24) = 40
    assert gate.capacity(1) == 40
    gate.staleness.set(0, "test")
    # eta = 0: (1 + 0 + 1) * 32 - (32 + 24) = 8
    assert gate.capacity(1) == 8


@pytest.mark.parametrize("version", [0, 1, 5, 10, 100])
def test_version_progression(version):
    gate = StalenessGate(batch_samples=32, max_staleness=2)
    gate.on_issued(40)
    gate.on_accepted(30)
    # (v + 2 + 1) * 32 - (30 + 10)
    assert gate.capacity(version) == (version + 3) * 32 - 40


def test_max_inflight_bounds_capacity():
    gate = StalenessGate(batch_samples=32, max_staleness=4, max_inflight=16)
    # staleness room (0 + 4 + 1) * 32 - 0 = 160, in-flight room 16 - 0 = 16
    assert gate.capacity(0) == 16
    gate.on_issued(16)
    # in-flight room 16 - 16 = 0
    assert gate.capacity(0) == 0
    gate.on_accepted(16)
    # staleness room 160 - (16 + 0) = 144, in-flight room 16 - 0 = 16
    assert gate.capacity(0) == 16


def test_capacity_never_negative_when_eta_shrinks():
    gate = StalenessGate(batch_samples=8, max_staleness=3)
    gate.on_issued(32)                       # (0 + 3 + 1) * 8 = 32: all of it
    gate.staleness.set(0, "test")
    # (0 + 0 + 1) * 8 - 32 = -24 -> 0
    assert gate.capacity(0) == 0
    gate.on_failed(24)
    # (0 + 0 + 1) * 8 - 8 = 0
    assert gate.capacity(0) == 0
    gate.staleness.set(2, "test")
    # growing eta lets it issue more at once: (0 + 2 + 1) * 8 - 8 = 16
    assert gate.capacity(0) == 16


def test_dropped_samples_give_capacity_back():
    gate = StalenessGate(batch_samples=8, max_staleness=0)
    gate.on_issued(8)
    gate.on_accepted(8)
    # (0 + 0 + 1) * 8 - (8 + 0) = 0
    assert gate.capacity(0) == 0
    gate.on_dropped(8)
    # (0 + 0 + 1) * 8 - (0 + 0) = 8
    assert gate.capacity(0) == 8
    assert gate.buffered == 0


def test_accounting_errors_raise():
    gate = StalenessGate(batch_samples=8, max_staleness=0)
    with pytest.raises(ValueError):
        gate.on_accepted(1)                  # nothing in flight
    with pytest.raises(ValueError):
        gate.on_failed(1)
    with pytest.raises(ValueError):
        gate.on_dropped(1)                   # nothing buffered
    with pytest.raises(ValueError):
        gate.on_consumed(1)
    with pytest.raises(ValueError):
        gate.on_issued(-1)
    with pytest.raises(ValueError):
        gate.staleness.set(-1, "test")
    with pytest.raises(ValueError):
        StalenessGate(batch_samples=0, max_staleness=0)
    with pytest.raises(ValueError):
        StalenessGate(batch_samples=8, max_staleness=0, max_inflight=0)


@pytest.mark.parametrize("recovered_version", [0, 5, 10, 50])
def test_start_at_gives_a_gate_the_history_of_its_version(recovered_version):
    gate = StalenessGate(batch_samples=32, max_staleness=1)
    # Without history: (v + 1 + 1) * 32 - 0, i.e. v batches too many (AReaL's recovery bug).
    assert gate.capacity(recovered_version) == (recovered_version + 2) * 32
    gate.start_at(recovered_version)
    # accepted_total = consumed_total = v * 32: (v + 1 + 1) * 32 - v * 32 = 64, as at version 0
    assert gate.accepted_total == gate.consumed_total == recovered_version * 32
    assert gate.capacity(recovered_version) == 64
    gate.on_issued(8)
    with pytest.raises(ValueError):
        gate.start_at(recovered_version)     # only a gate without history


def test_state_dict_round_trip_keeps_capacity():
    gate = StalenessGate(batch_samples=32, max_staleness=2, max_inflight=100)
    gate.on_issued(90)
    gate.on_accepted(70)
    gate.on_consumed(64)
    gate.on_dropped(2)
    state = json.loads(json.dumps(gate.state_dict()))
    other = StalenessGate(batch_samples=32, max_staleness=0, max_inflight=100)
    other.load_state_dict(state)
    # accepted 68, in flight 20: min((2 + 2 + 1) * 32 - 88, 100 - 20) = min(72, 80) = 72
    assert other.capacity(2) == gate.capacity(2) == 72
    assert other.max_staleness == 2 and other.buffered == 4
    bad = dict(state, consumed_total=1000)
    with pytest.raises(ValueError):
        other.load_state_dict(bad)


def test_untrained_samples_give_their_capacity_back():
    # B = 4, eta = 0: (0 + 0 + 1) * 4 = 4 may be issued at version 0.
    gate = StalenessGate(4, 0)
    gate.on_issued(4)
    gate.on_accepted(4)
    gate.on_consumed(4)
    assert gate.capacity(0) == 0            # 4 - (4 accepted + 0 in flight)
    gate.on_untrained(4)                    # the step was skipped: nothing was trained
    assert gate.capacity(0) == 4 and gate.consumed_total == 0
    with pytest.raises(ValueError, match="on_untrained"):
        gate.on_untrained(1)
