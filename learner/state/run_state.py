"""The run's identity and counters: one object the service, the checkpoints and the event log read.

``run_id`` names the run across lives (a resume keeps it), ``version`` is the policy version
(docs/design.md §3), ``assignment_counter`` numbers training assignments (``<run_id>-a<n>``).
A checkpoint saves :meth:`RunState.state_dict` and a resume loads it first, before any component
that reads the run id is built, so nothing can copy the id of a life that is about to be replaced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunState:
    run_id: str
    version: int = 0
    assignment_counter: int = 0

    def state_dict(self) -> dict:
        return {"run_id": self.run_id, "version": self.version,
                "assignment_counter": self.assignment_counter}

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint's state (extra keys are other parts'); ``ValueError`` / ``KeyError`` /
        ``TypeError`` when it is not a run state, with nothing changed."""
        run_id, version, counter = state["run_id"], state["version"], state["assignment_counter"]
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id {run_id!r} is not a non-empty string")
        for name, value in (("version", version), ("assignment_counter", counter)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} {value!r} is not a non-negative integer")
        self.run_id, self.version, self.assignment_counter = run_id, version, counter

    # What components are handed to read the run state at use time (one provider for all).
    def current_version(self) -> int:
        return self.version

    def current_run_id(self) -> str:
        return self.run_id

    def next_assignment_id(self) -> str:
        """The id of the next training assignment (the counter moves on)."""
        self.assignment_counter += 1
        return f"{self.run_id}-a{self.assignment_counter}"
