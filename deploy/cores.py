"""How ``slipstream run`` shares the machine's cores among the processes it starts.

Every process left at torch's default takes one intra-op thread per core, so a learner and S
servers on N cores run (S + 1) * N threads that preempt each other in the middle of every matmul.
Measured on 2 cores with the demo: 560 trained samples/s with default threads, 773-824/s with
learner 1 + server 1. The rule, for N cores and S servers, P = S + 1 processes:

- nothing set: each process gets ``max(1, N // P)`` threads and the learner also gets the
  remainder ``N - P * (N // P)`` (training is the heavier job);
- ``learner.threads`` set (nonzero): it is kept; each server gets ``max(1, (N - learner) // S)``;
- ``rollout.threads`` set (nonzero): it is kept; the learner gets ``max(1, N - S * rollout)``;
- both set: both are kept.

Nobody gets fewer than one thread, so more processes than cores oversubscribe by design (the
alternative is not starting them).

Synchronous runs (``learner.staleness.max_staleness: 0``) are the exception for the learner: it trains while
every server waits for its weights, and the servers generate while it waits for their samples, so
when ``learner.threads`` is not set it gets all N cores (the servers keep their share above).
Measured on 2 cores with the demo at eta 0: the step 0.096 -> 0.083 s, 340-360 -> 386-397
samples/s. The split is made at start: a run whose η is raised live (``slipstream ctl set
max_staleness``) keeps it, and its learner then competes with the servers for the cores.

Pinning (``launcher.pin_cores``, on by default): when the split uses the cores exactly (learner +
servers' threads = N, as the split above gives whenever there are at least as many cores as
processes and η > 0), each process is pinned to its own cores (Linux CPU affinity, set by the
launcher on the child right after it starts; every thread it starts later inherits it). Without
pinning, each process's other threads (the asyncio loop, ZeroMQ's I/O threads, the train loop
between steps) wake on whichever core is free first and preempt the other process's compute
thread. Measured on 2 cores with the demo at η = 2 (tests/bench/bench_async.py, two interleaved
pairs): the train loop's time between steps 3.1-3.4 -> 2.1-2.3 ms, of the ideal overlap
0.94 -> 0.96. A split that oversubscribes (η = 0's learner on every core, or more processes than
cores) or leaves cores over, and a CPU quota below the affinity set (a container's cores are
time, not CPUs), are left to the OS.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def quota_cores(cpu_max: str) -> int | None:
    """Cores allowed by a cgroup v2 ``cpu.max`` line (``"200000 100000"`` -> 2; ``"max ..."`` -> None)."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def available_cores(cpu_max_file: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota = quota_cores(cpu_max_file.read_text())
    except OSError:
        quota = None
    return max(1, min(cores, quota) if quota else cores)


def share_cores(cores: int, servers: int, learner_threads: int = 0,
                rollout_threads: int = 0, synchronous: bool = False) -> tuple[int, int]:
    """``(learner threads, threads of each server)`` by the rule above (0 = not set);
    ``synchronous``: the run's max_staleness is 0 (the learner and the servers take turns)."""
    if cores < 1 or servers < 1:
        raise ValueError(f"share_cores needs cores >= 1 and servers >= 1 (got {cores}, {servers})")
    if learner_threads and rollout_threads:
        return learner_threads, rollout_threads
    if learner_threads:
        return learner_threads, max(1, (cores - learner_threads) // servers)
    if rollout_threads:
        return (cores if synchronous else max(1, cores - servers * rollout_threads)), rollout_threads
    each = max(1, cores // (servers + 1))
    return (cores if synchronous else each + max(0, cores - each * (servers + 1))), each


def allowed_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity); empty where the OS has no affinity."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def plan_affinity(cpus: list[int], servers: int, learner_threads: int, rollout_threads: int,
                  cores: int | None = None) -> dict[str, list[int]] | None:
    """Each process's own CPUs, ``{"learner": [...], "rollout-0": [...], ...}``: consecutive
    blocks of ``cpus``, the learner's first; None when the split does not use ``cpus`` exactly
    (oversubscribed, cores left over) or ``cores`` (the quota-capped count) is fewer than them."""
    if (not cpus or (cores is not None and cores < len(cpus))
            or learner_threads + servers * rollout_threads != len(cpus)):
        return None
    plan = {"learner": cpus[:learner_threads]}
    for i in range(servers):
        start = learner_threads + i * rollout_threads
        plan[f"rollout-{i}"] = cpus[start:start + rollout_threads]
    return plan


def pin(pid: int, cpus: list[int]) -> bool:
    """Pin process ``pid`` to ``cpus``; False (nothing changed) where the OS refuses."""
    try:
        os.sched_setaffinity(pid, cpus)
        return True
    except (AttributeError, OSError):
        return False
