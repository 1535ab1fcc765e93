"""Three hosts for fleet tests: real network namespaces when this machine allows them, else three
loopback addresses.

With root and ``ip netns``: three namespaces ``sw<tag>-h0..h2``, each with its own network stack
(a ``veth0`` with ``10.<x>.<y>.<i+1>/24`` and ``lo``), wired to a bridge in a fourth namespace
(nothing is added to this machine's own network namespace), all removed at teardown. A host's
processes run through ``ip netns exec``; :meth:`Hosts.partition` takes a host's link down,
:meth:`Hosts.heal` up again.
Without it: the addresses ``127.0.<y>.<i+1>`` on this machine's loopback (no partition).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Hosts", "netns_available", "three_hosts"]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def netns_available() -> bool:
    """Root, ``ip`` and a namespace that can be made here (a container may forbid it);
    ``SERVEWATCH_TEST_LOOPBACK_HOSTS=1`` forces the loopback variant."""
    if os.environ.get("SERVEWATCH_TEST_LOOPBACK_HOSTS") == "1" or os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"swprobe{os.getpid()}"
    ok = _ip("netns", "add", probe).returncode == 0
    if ok:
        _ip("netns", "del", probe)
    return ok


@dataclass
class Hosts:
    """Three hosts: where each one's processes run and which address it has."""

    names: tuple[str, ...]
    addresses: tuple[str, ...]
    ifname: str
    netns: bool

    def prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.names[i]] if self.netns else []

    def partition(self, i: int) -> None:
        """Cut host ``i`` off the network (its link goes down)."""
        assert self.netns, "a partition needs real network namespaces"
        done = _ip("-n", self.names[i], "link", "set", "veth0", "down")
        assert done.returncode == 0, done.stderr

    def heal(self, i: int) -> None:
        """Put host ``i`` back on the network (its link up again)."""
        assert self.netns, "a partition needs real network namespaces"
        done = _ip("-n", self.names[i], "link", "set", "veth0", "up")
        assert done.returncode == 0, done.stderr


def _make(tag: str, x: int, y: int) -> Hosts:
    bridge = f"sw{tag}-br"
    names = tuple(f"sw{tag}-h{i}" for i in range(3))
    steps = [("netns", "add", bridge), ("-n", bridge, "link", "add", "br0", "type", "bridge"),
             ("-n", bridge, "link", "set", "br0", "up")]
    addresses = []
    for i, ns in enumerate(names):
        address = f"10.{x}.{y}.{i + 1}"
        addresses.append(address)
        steps += [("netns", "add", ns), ("link", "add", "veth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", bridge),
                  ("-n", ns, "addr", "add", f"{address}/24", "dev", "veth0"), ("-n", ns, "link", "set", "veth0", "up"),
                  ("-n", ns, "link", "set", "lo", "up"), ("-n", bridge, "link", "set", f"p{i}", "master", "br0"),
                  ("-n", bridge, "link", "set", f"p{i}", "up")]
    for step in steps:
        done = _ip(*step)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
    return Hosts(names, tuple(addresses), "veth0", True)


def three_hosts() -> Iterator[Hosts]:
    """The fixture body: three hosts, torn down after the test."""
    tag = f"{os.getpid() % 10000}{random.randrange(100, 1000)}"
    x, y = random.randrange(200, 250), random.randrange(1, 250)
    if not netns_available():
        yield Hosts(tuple(f"host-{i}" for i in range(3)), tuple(f"127.0.{y}.{i + 1}" for i in range(3)), "lo", False)
        return
    try:
        hosts = _make(tag, x, y)
        yield hosts
    finally:
        for ns in (f"sw{tag}-h0", f"sw{tag}-h1", f"sw{tag}-h2", f"sw{tag}-br"):
            _ip("netns", "del", ns)
