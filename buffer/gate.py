"""The staleness gate: how many samples generation may run ahead of training (docs/design.md §3).

Counted in samples. With learner version ``v``, batch size ``B`` (samples per policy step) and
``max_staleness`` η::

    capacity(v) = max(0, min((v + η + 1) · B − (accepted_total + in_flight),
                             max_inflight − in_flight))

- ``accepted_total``: every sample ever accepted and not dropped since (trained or still buffered);
- ``in_flight``: samples issued and not yet resolved (returned, failed or released);
- the second term exists only when ``max_inflight`` is set.

Why it bounds staleness: a sample issued while the learner is at ``u`` is among the first
``(u + η + 1) · B`` samples of the run, so it is trained in a batch no later than batch ``u + η``,
that is, by a learner at version ≤ ``u + η``. Generated with the version-``u`` weights, its
staleness is ≤ η. Stale work is *prevented*, not dropped; the buffer's filter catches the rest
(servers that apply new weights late).

Worked example, ``B = 32`` (4 prompts × 8 completions), η = 1::

    v = 0, nothing yet       capacity = (0 + 1 + 1) · 32 − (0 + 0)   = 64   issue 8 groups of 8
    32 back, 32 in flight    capacity = (0 + 1 + 1) · 32 − (32 + 32) = 0    generation waits
    batch 0 trained, v = 1   capacity = (1 + 1 + 1) · 32 − (32 + 32) = 32   trained samples still count
    8 in flight come back    capacity = (1 + 1 + 1) · 32 − (32 + 24) = 40   stale work gives its
      stale (dropped)                                                       capacity back
    η set to 0 at v = 1      capacity = (1 + 0 + 1) · 32 − (32 + 24) = 8

With η = 0 the rule is synchronous PPO: a batch is issued only once the previous one was trained.

Every change of the gate moves whole groups when ``B`` and ``max_inflight`` are multiples of the
group size, so the capacity is then a multiple of the group size too.

Resume: the rule depends on ``accepted_total``, so it must survive a restart together with ``v``.
A gate that learns ``v`` but not its history (AReaL's bug, fixed there in PR #1345) would compute
``(v + η + 1) · B − 0`` and let generation run ``v`` batches ahead. :meth:`state_dict` saves the
totals; :meth:`start_at` gives a gate without history the history of ``v`` trained batches.
"""

from __future__ import annotations

from typing import Any

from buffer.staleness import StalenessLimit


def _check_count(n: int, what: str) -> int:
    if type(n) is not int or n < 0:
        raise ValueError(f"{what}: expected a non-negative integer, got {n!r}")
    return n


class StalenessGate:
    """Admission control by credits, counted in samples (the rule is in the module docstring).

    State transitions, each named after the event that causes it::

        on_issued(n)     in_flight += n               work handed to a rollout server
        on_accepted(n)   in_flight -= n, accepted += n  results buffered
        on_failed(n)     in_flight -= n               expired, failed, rejected or released work
        on_dropped(n)    accepted  -= n               buffered samples dropped (stale, broken group)
        on_consumed(n)   consumed  += n               trained; still counted in accepted_total

    An accounting call that would make a count negative raises ``ValueError``: it is a bug in the
    caller, and a silent clamp would hide a gate that drifts.
    """

    def __init__(self, batch_samples: int, max_staleness: int | StalenessLimit,
                 max_inflight: int | None = None):
        if type(batch_samples) is not int or batch_samples < 1:
            raise ValueError(f"batch_samples must be an integer >= 1, got {batch_samples!r}")
        if max_inflight is not None and (type(max_inflight) is not int or max_inflight < 1):
            raise ValueError(f"max_inflight must be None or an integer >= 1, got {max_inflight!r}")
        self.batch_samples = batch_samples
        self.staleness = (max_staleness if isinstance(max_staleness, StalenessLimit)
                          else StalenessLimit(max_staleness))
        """η's owner (buffer.staleness): the gate reads it, never sets it."""
        self.max_inflight = max_inflight
        self.accepted_total = 0      # accepted and not dropped: trained or buffered
        self.in_flight = 0           # issued, not resolved
        self.consumed_total = 0      # trained (included in accepted_total)

    # -- the rule ---------------------------------------------------------------------------------

    @property
    def max_staleness(self) -> int:
        """η now (read from its owner, :attr:`staleness`)."""
        return self.staleness.eta

    def capacity(self, version: int) -> int:
        """Samples that may be issued now, at learner version ``version`` (never negative)."""
        room = (version + self.max_staleness + 1) * self.batch_samples - (self.accepted_total + self.in_flight)
        if self.max_inflight is not None:
            room = min(room, self.max_inflight - self.in_flight)
        return room if room > 0 else 0

    @property
    def buffered(self) -> int:
        """Samples accepted and neither trained nor dropped."""
        return self.accepted_total - self.consumed_total

    # -- transitions ------------------------------------------------------------------------------

    def on_issued(self, n: int) -> None:
        self.in_flight += _check_count(n, "on_issued")

    def on_accepted(self, n: int = 1) -> None:
        if not 0 <= n <= self.in_flight:
            raise ValueError(f"on_accepted({n}) with {self.in_flight} samples in flight")
        self.in_flight -= n
        self.accepted_total += n

    def on_failed(self, n: int = 1) -> None:
        if _check_count(n, "on_failed") > self.in_flight:
            raise ValueError(f"on_failed({n}) with only {self.in_flight} samples in flight")
        self.in_flight -= n

    def on_dropped(self, n: int = 1) -> None:
        if _check_count(n, "on_dropped") > self.buffered:
            raise ValueError(f"on_dropped({n}) with only {self.buffered} samples buffered")
        self.accepted_total -= n

    def on_consumed(self, n: int) -> None:
        if _check_count(n, "on_consumed") > self.buffered:
            raise ValueError(f"on_consumed({n}) with only {self.buffered} samples buffered")
        self.consumed_total += n

    def on_untrained(self, n: int) -> None:
        """``n`` consumed samples were not trained after all (a skipped step): they leave the
        gate's history as dropped work does, so their capacity comes back."""
        if _check_count(n, "on_untrained") > self.consumed_total:
            raise ValueError(f"on_untrained({n}) with only {self.consumed_total} samples consumed")
        self.consumed_total -= n
        self.accepted_total -= n

    def start_at(self, version: int) -> None:
        """Give a gate without history the history of ``version`` trained batches.

        ``accepted_total = consumed_total = version · B``, so ``capacity(version) = (η + 1) · B``
        as in a run that got there step by step. Refused once the gate has counted anything.
        """
        _check_count(version, "start_at")
        if self.accepted_total or self.in_flight or self.consumed_total:
            raise ValueError("start_at() on a gate that has already counted samples")
        self.accepted_total = self.consumed_total = version * self.batch_samples

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain data. ``in_flight`` is saved as it is; after a restart the owner of the leases
        must resolve it (the buffer re-issues or fails them, see ``RolloutBuffer.load_state_dict``)."""
        return {"batch_samples": self.batch_samples, "max_staleness": self.max_staleness,
                "max_inflight": self.max_inflight, "accepted_total": self.accepted_total,
                "in_flight": self.in_flight, "consumed_total": self.consumed_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore totals and η. ``batch_samples`` and ``max_inflight`` stay as constructed
        (configuration, not state)."""
        accepted = _check_count(state["accepted_total"], "accepted_total")
        consumed = _check_count(state["consumed_total"], "consumed_total")
        if consumed > accepted:
            raise ValueError(f"gate state: consumed_total {consumed} > accepted_total {accepted}")
        self.staleness.restore(_check_count(state["max_staleness"], "max_staleness"))
        self.accepted_total, self.consumed_total = accepted, consumed
        self.in_flight = _check_count(state["in_flight"], "in_flight")

    def __repr__(self) -> str:
        return (f"StalenessGate(B={self.batch_samples}, eta={self.max_staleness}, "
                f"max_inflight={self.max_inflight}, accepted_total={self.accepted_total}, "
                f"in_flight={self.in_flight}, consumed_total={self.consumed_total})")
