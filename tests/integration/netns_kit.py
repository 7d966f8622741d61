"""Simulated hosts for multi-host tests and benchmarks (issue 28 items 5, 6): Linux network
namespaces joined by veth links through a bridge, links shaped with ``tc``.

Every address is one this kit assigns inside namespaces it made, in the benchmarking range
198.18.0.0/15 (RFC 2544); traffic goes only between those namespaces (and each one's own
loopback): the bridge lives in a namespace of its own, no link touches the root namespace, no
route leaves. Names carry the creating process's id, so two runs do not collide, and
:meth:`Hosts.close` removes every namespace (their links go with them) even when the test
failed; :func:`leftovers` names what a crashed run left.

Needs root (``ip netns``), the ``ip`` and ``tc`` tools and the kernel's veth, bridge and tbf.
:func:`unavailable` says why not, for the skip; ``SLIPSTREAM_REQUIRE_NETNS=1`` (``.ci/run``)
turns that skip into a failure. netem (delay) is not always built: a link gets ``tc tbf`` (the
rate) always and ``netem`` (the delay) where the kernel has it (:attr:`Hosts.delay_shaped`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

NET = "198.18.0"
PREFIX = f"ss{os.getpid() % 100000}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _in(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                          check=check, timeout=30)


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool is not installed (iproute2)"
    probe = f"{PREFIX}probe"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"ip netns add failed: {r.stderr.strip()}"
        r = _in(probe, "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1", check=False)
        if r.returncode != 0:
            return f"veth links cannot be made: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def leftovers() -> list[str]:
    """Namespaces of this kit that exist now (any process's)."""
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith("ss") and line.split()]


@dataclass
class Host:
    name: str              # the namespace
    address: str           # its address on the simulated network

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: the pid is argv's)."""
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class Hosts:
    """``n`` hosts on one switch, each link ``rate`` (tbf) and ``delay`` (netem, if built)."""

    n: int
    rate: str = "1gbit"
    delay: str = "1ms"
    hosts: list[Host] = field(default_factory=list)
    made: list[str] = field(default_factory=list)
    delay_shaped: bool = False

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self, name: str) -> str:
        _ip("netns", "add", name)
        self.made.append(name)
        _in(name, "ip", "link", "set", "lo", "up")
        return name

    def _make(self) -> None:
        hub = self._ns(f"{PREFIX}hub")
        _in(hub, "ip", "link", "add", "br0", "type", "bridge")
        _in(hub, "ip", "link", "set", "br0", "up")
        shaped = []
        for i in range(self.n):
            ns = self._ns(f"{PREFIX}h{i}")
            inner, outer = "eth0", f"p{i}"
            _in(hub, "ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            _in(hub, "ip", "link", "set", outer, "master", "br0")
            _in(hub, "ip", "link", "set", outer, "up")
            address = f"{NET}.{i + 1}"
            _in(ns, "ip", "addr", "add", f"{address}/24", "dev", inner)
            _in(ns, "ip", "link", "set", inner, "up")
            shaped += [(ns, inner), (hub, outer)]        # both directions of the link
            self.hosts.append(Host(ns, address))
        netem = _in(shaped[0][0], "tc", "qdisc", "add", "dev", shaped[0][1], "root", "handle", "1:",
                    "netem", "delay", self.delay, check=False).returncode == 0
        if netem:
            _in(shaped[0][0], "tc", "qdisc", "del", "dev", shaped[0][1], "root", check=False)
        self.delay_shaped = netem
        for ns, dev in shaped:
            if netem:
                _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", self.delay)
                _in(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf",
                    "rate", self.rate, "burst", "256kb", "latency", "50ms")
            else:
                _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst",
                    "256kb", "latency", "50ms")

    def close(self) -> None:
        """Remove every namespace made (a namespace's links and qdiscs go with it)."""
        while self.made:
            _ip("netns", "del", self.made.pop(), check=False)
