"""buffer: what may be generated (staleness gate, leases) and what may be trained (groups, batches).

Imports the stdlib, numpy and ``protocol`` only — never torch (docs/design.md §2). One concept per module:

    gate.py            StalenessGate: the capacity rule (AReaL's), counted in samples
    leases.py          LeaseTable, Lease: holder, deadline and attempt of every assignment
    dedupe.py          RecentKeys: bounded memory of ids already seen
    records.py         AckStatus, Batch
    rollout_buffer.py  RolloutBuffer: all of the above for one learner, asyncio
"""

from buffer.dedupe import RecentKeys
from buffer.gate import StalenessGate
from buffer.leases import Lease, LeaseState, LeaseTable
from buffer.records import AckStatus, Batch
from buffer.rollout_buffer import COUNTER_NAMES, STALE_POLICIES, RolloutBuffer

__all__ = [
    "COUNTER_NAMES", "STALE_POLICIES", "AckStatus", "Batch", "Lease", "LeaseState", "LeaseTable",
    "RecentKeys", "RolloutBuffer", "StalenessGate",
]
