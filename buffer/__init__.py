"""buffer: what may be generated (staleness gate, leases) and what may be trained (groups, batches).

Imports the stdlib, numpy and ``protocol`` only — never torch (docs/design.md §2). One concept per module:

    staleness.py       StalenessLimit: η's one owner (ctl, the adaptive controller and a resume
                       set it there; the gate and the buffer read it); StalenessController
    gate.py            StalenessGate: the capacity rule (AReaL's), counted in samples
    leases.py          LeaseTable, Lease: holder, deadline and attempt of every assignment
    dedupe.py          RecentKeys: bounded memory of ids already seen
    records.py         AckStatus, Batch, COUNTER_NAMES: what the buffer hands out (the counters'
                       meanings and conservation equations)
    groups.py          Group: one assignment's slots; select_groups, assemble_batch: which
                       complete groups make the next batch (length bucketing) and its staleness
    checkpoint.py      the buffer's state_dict / load_state_dict as plain data (resume)
    rollout_buffer.py  RolloutBuffer: all of the above for one learner, asyncio; the delivery
                       argument and when groups are dropped
"""

from buffer.dedupe import RecentKeys
from buffer.gate import StalenessGate
from buffer.leases import Lease, LeaseState, LeaseTable
from buffer.records import COUNTER_NAMES, AckStatus, Batch
from buffer.rollout_buffer import STALE_POLICIES, RolloutBuffer
from buffer.staleness import StalenessController, StalenessDecision, StalenessLimit

__all__ = [
    "COUNTER_NAMES", "STALE_POLICIES", "AckStatus", "Batch", "Lease", "LeaseState", "LeaseTable",
    "RecentKeys", "RolloutBuffer", "StalenessController", "StalenessDecision", "StalenessGate",
    "StalenessLimit",
]
