"""Counters whose label values are known in advance are exposed at 0 from the start (issue 30.9:
a dashboard panel on a counter that has not fired showed "No data"), on both processes."""

from __future__ import annotations

import re

import rollout_server.metrics as rm
from learner.metrics import LearnerMetrics


def test_the_error_kinds_are_the_documented_table():
    table = re.split(r"^=+ =+$", rm.__doc__, flags=re.M)[2]
    documented = tuple(line.split()[0] for line in table.splitlines() if line[:1].isalpha())
    assert rm.ERROR_KINDS == documented


def test_known_label_sets_are_exposed_at_zero_before_anything_happens():
    text = rm.RolloutMetrics().render()[0].decode()
    for kind in rm.ERROR_KINDS:
        assert f'slipstream_rollout_errors_total{{kind="{kind}"}} 0.0' in text
    learner = LearnerMetrics().render()[0].decode()
    for line in ('slipstream_samples_total{status="stale"} 0.0',
                 'slipstream_send_dropped_total{reason="full",socket="weights"} 0.0',
                 'slipstream_server_errors_total{code="weights_failed"} 0.0',
                 'slipstream_rollout_servers_lost_total{reason="timeout"} 0.0',
                 'slipstream_protocol_errors_total{socket="control"} 0.0'):
        assert line in learner, line
