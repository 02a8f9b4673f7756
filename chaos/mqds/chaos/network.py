"""Cutting the network between nodes: real partitions in network namespaces, or the Raft fault hook.

:class:`NetnsNetwork` (preferred; needs root and ``ip``/``tc``) puts every node
in a network namespace of its own, joined to a bridge in the caller's
namespace by a veth pair, each with its own address of a private /24. The
workload and the harness reach every node through the bridge. A cut between
two nodes is a ``tc`` filter on each side's interface that sends packets to
the other's address into a class whose queue holds nothing (``pfifo limit 0``)
so every packet is dropped: Raft, snapshot transfers and internal admin calls
between the two stop, exactly as in a real partition, while clients still
reach both. (Filters with a drop action need the ``act_gact`` kernel module,
which containers often lack; HTB, u32 and pfifo are built in more often.)

:class:`HookNetwork` is the fallback when namespaces cannot be made (no root,
no ``ip``): nodes on 127.0.0.1, and a cut is the nodes' fault-injection hook
(``InjectFault``), which drops Raft messages between the sides but leaves
other node-to-node calls (snapshot fetches, forwarded metadata proposals)
working.

Namespaces, bridge and veths are named after the process id
(``mqds-chaos-<pid>-<node>``, ``mqc<pid>b``), removed by :meth:`close`, and a
later run removes those a dead process left behind.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

NETNS_PREFIX = "mqds-chaos-"
_LINK_PREFIX = "mqc"


class NetworkError(RuntimeError):
    """A namespace, link or filter could not be set up; the message has the command's error."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


class HookNetwork:
    """Nodes on loopback; cuts through the nodes' InjectFault hook (Raft traffic only)."""

    kind = "hook"

    def __init__(self, inject: Callable[[str, list[str]], None] | None = None) -> None:
        # inject(node, blocked_peers): set later by the cluster, which knows the secret.
        self.inject = inject

    def host(self, node_id: str) -> str:
        return "127.0.0.1"

    def netns(self, node_id: str) -> str | None:
        return None

    def add_host(self, node_id: str) -> str:
        return self.host(node_id)

    def apply(self, blocked: Mapping[str, set[str]], live: list[str]) -> None:
        """Make each live node drop Raft traffic with the nodes ``blocked[node]`` (the rest heal)."""
        assert self.inject is not None
        for node_id in live:
            self.inject(node_id, sorted(blocked.get(node_id, set())))

    def heal(self, live: list[str]) -> None:
        self.apply({}, live)

    def close(self) -> None:
        pass


class NetnsNetwork:
    """One network namespace per node, a bridge between them, tc filters for cuts."""

    kind = "netns"

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.tag = f"{self.pid}"
        self.bridge = f"{_LINK_PREFIX}{self.tag}b"
        self.subnet = _free_subnet()
        self.gateway = str(self.subnet.network_address + 1)
        self._hosts: dict[str, str] = {}
        self._netns: dict[str, str] = {}
        self._veths: dict[str, str] = {}
        self._cut: dict[str, set[str]] = {}
        self._closed = False
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except (NetworkError, OSError, subprocess.TimeoutExpired):
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be used here, else why not."""
        if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the {tool!r} command is missing"
        return None

    def host(self, node_id: str) -> str:
        return self._hosts[node_id]

    def netns(self, node_id: str) -> str | None:
        return self._netns.get(node_id)

    def add_host(self, node_id: str) -> str:
        """Create ``node_id``'s namespace and link (once); its address."""
        if node_id in self._hosts:
            return self._hosts[node_id]
        index = len(self._hosts) + 1
        address = str(self.subnet.network_address + 10 + index)
        ns = f"{NETNS_PREFIX}{self.tag}-{node_id}"
        veth = f"{_LINK_PREFIX}{self.tag}v{index}"
        inside = f"{_LINK_PREFIX}{self.tag}p{index}"
        _run("ip", "netns", "add", ns)
        self._netns[node_id] = ns
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", inside)
        self._veths[node_id] = veth
        _run("ip", "link", "set", inside, "netns", ns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "-n", ns, "link", "set", inside, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._hosts[node_id] = address
        return address

    def _tc(self, node_id: str, *args: str, check: bool = True) -> None:
        _run("ip", "netns", "exec", self._netns[node_id], "tc", *args, check=check)

    def _set_cut(self, node_id: str, peers: set[str]) -> None:
        if self._cut.get(node_id, set()) == peers:
            return
        _install_cut(self._netns[node_id], sorted(self._hosts[p] for p in peers))
        self._cut[node_id] = set(peers)

    def check_cuts(self) -> None:
        """Raise NetworkError unless this kernel has what a cut needs (HTB, u32, pfifo), on a scratch namespace."""
        ns = f"{NETNS_PREFIX}{self.tag}-probe"
        _run("ip", "netns", "add", ns)
        try:
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _install_cut(ns, [self.gateway])
            _install_cut(ns, [])
        finally:
            _run("ip", "netns", "del", ns, check=False)

    def apply(self, blocked: Mapping[str, set[str]], live: list[str]) -> None:
        """Drop all traffic from each node to the nodes ``blocked[node]``; other cuts heal."""
        for node_id in self._hosts:
            self._set_cut(node_id, {p for p in blocked.get(node_id, set()) if p in self._hosts})

    def heal(self, live: list[str]) -> None:
        self.apply({}, live)

    def close(self) -> None:
        """Remove the namespaces, links and bridge (the nodes in them must be stopped first)."""
        if self._closed:
            return
        self._closed = True
        for ns in self._netns.values():
            _run("ip", "netns", "del", ns, check=False)
        for veth in self._veths.values():
            _run("ip", "link", "del", veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)


def _install_cut(ns: str, addresses: list[str]) -> None:
    """Make ``eth0`` in namespace ``ns`` drop every packet to ``addresses`` (none: pass everything)."""

    def tc(*args: str, check: bool = True) -> None:
        _run("ip", "netns", "exec", ns, "tc", *args, check=check)

    tc("qdisc", "del", "dev", "eth0", "root", check=False)
    if not addresses:
        return
    # Class 1:1 passes everything (the default); class 1:2 queues nothing, so drops.
    tc("qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
    for minor in ("1", "2"):
        tc(
            "class",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:",
            "classid",
            f"1:{minor}",
            "htb",
            "rate",
            "10gbit",
            "quantum",
            "60000",
        )
    tc("qdisc", "add", "dev", "eth0", "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
    for address in addresses:
        tc(
            *("filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1"),
            *("u32", "match", "ip", "dst", f"{address}/32", "flowid", "1:2"),
        )


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no address or route here uses."""
    used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for cmd in (["ip", "-4", "-o", "addr"], ["ip", "-4", "route"]):
        out = _run(*cmd, check=False).stdout
        for match in re.finditer(r"(\d+\.\d+\.\d+\.\d+)(/\d+)?", out):
            try:
                used.append(ipaddress.ip_network(match.group(1) + (match.group(2) or "/32"), strict=False))
            except ValueError:
                continue
    rng = random.Random()
    for _ in range(500):
        candidate = ipaddress.IPv4Network(f"10.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise NetworkError("found no free 10.x.y.0/24 for the chaos network")


def remove_stale() -> list[str]:
    """Remove namespaces and links earlier chaos runs left behind (their process is gone); their names."""
    removed: list[str] = []
    if NetnsNetwork.available() is not None:
        return removed
    names = _run("ip", "netns", "list", check=False).stdout.split()
    for name in names:
        match = re.fullmatch(rf"{re.escape(NETNS_PREFIX)}(\d+)-.+", name)
        if match and not _pid_alive(int(match.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for match in re.finditer(rf"^\d+: ({_LINK_PREFIX}(\d+)[bvp]\d*)[@:]", links, re.MULTILINE):
        if not _pid_alive(int(match.group(2))):
            _run("ip", "link", "del", match.group(1), check=False)
            removed.append(match.group(1))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_network(kind: str) -> HookNetwork | NetnsNetwork:
    """``netns``, ``hook`` or ``auto`` (namespaces when they can be made here, else the hook)."""
    if kind == "hook":
        return HookNetwork()
    why = NetnsNetwork.available()
    if why is None:
        remove_stale()
        try:
            network = NetnsNetwork()
        except (NetworkError, OSError, subprocess.TimeoutExpired) as err:
            why = str(err)
        else:
            try:
                network.check_cuts()
                return network
            except (NetworkError, OSError, subprocess.TimeoutExpired) as err:
                network.close()
                why = f"tc cannot drop traffic here: {err}"
    if kind == "netns":
        raise NetworkError(f"cannot use network namespaces: {why}")
    log.warning("network namespaces unavailable (%s); partitions use the Raft fault hook", why)
    return HookNetwork()
