"""The local cluster's network per node, made with iproute2's ``ip`` (see :mod:`.netplan` for the layout and
the faults). :meth:`NodeNetwork.create` makes the bridge, the namespaces and the veth pairs and records what it
made in ``<dir>/network.json`` before making anything else, so that :func:`remove_recorded` takes it all away
even after the control plane was killed; :meth:`NodeNetwork.remove` does so at ``down``.

A pod's processes enter their node's namespace in the child between fork and exec (:meth:`NodeNetwork.enter`):
``setns`` to the node's network namespace, then a UTS and a mount namespace of the pod's own, where the hostname is
the pod's and ``/etc/hosts`` names it at the pod's IP, as a kubelet writes it. That is what gloo needs: it binds
the address the hostname resolves to, and a pod that resolved the machine's name would bind loopback and tell its
peers an address they cannot reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from stalwart.local.netplan import HOST, MTU, NOWHERE, Cut, NetworkPlan, blocked, pick_octets

log = logging.getLogger(__name__)
RECORD = "network.json"
_NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNS = 0x00020000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
#: Seconds one ``ip`` batch may take (each is a handful of netlink requests).
_IP_TIMEOUT = 30.0


class NetworkUnavailable(RuntimeError):
    """The network per node cannot be made here; the message says what is missing."""


def missing_rights() -> str | None:
    """Why this process cannot make network namespaces (no root, no ``ip``), or None when it may try."""
    if os.geteuid() != 0:
        return (f"network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); this process runs as uid "
                f"{os.geteuid()}")
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's 'ip' on PATH, and there is none"
    return None


def _ip(lines: Iterable[str], netns: str | None = None, *, force: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``ip`` commands as one batch (one process for many requests), in ``netns`` if given. ``force``: go on
    past a failing line (removal, where a part may already be gone)."""
    cmd = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"]
    text = "".join(f"{line}\n" for line in lines)
    return subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False)


def _checked(lines: list[str], netns: str | None = None) -> None:
    result = _ip(lines, netns)
    if result.returncode != 0:
        where = f" in namespace {netns}" if netns else ""
        raise NetworkUnavailable(f"ip{where} failed: {result.stderr.strip() or result.stdout.strip()}")


def _machine_networks() -> list[str]:
    """The networks this machine routes or has an address in (any namespace of ours excluded: none exist yet)."""
    out = []
    for args in (["-4", "-o", "addr", "show"], ["-4", "route", "show", "table", "all"]):
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False)
        for line in result.stdout.splitlines():
            words = line.split()
            if "inet" in words:
                out.append(words[words.index("inet") + 1])
            elif words and words[0] not in ("default", "broadcast", "local", "unreachable", "blackhole"):
                out.append(words[0])
            elif len(words) > 1 and words[0] in ("broadcast", "local"):
                out.append(words[1])
    return out


class NodeNetwork:
    """A cluster's network per node (made by :meth:`create`), its pods' addresses and the cuts in force."""

    def __init__(self, plan: NetworkPlan, record: Path) -> None:
        self.plan = plan
        self.record = record
        #: Each node's pod addresses now (its InternalIP is the plan's).
        self.addresses: dict[str, set[str]] = {n: set() for n in plan.nodes}
        self.cuts: dict[str, Cut] = {}
        self._blocked: frozenset[tuple[str, str]] = frozenset()

    # --- making and removing ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, nodes: list[str], *, mtu: int = MTU) -> NodeNetwork:
        """Make the network of :mod:`.netplan` for ``nodes``, its links at ``mtu``; :class:`NetworkUnavailable`
        (having removed whatever it made) when this process lacks the rights or ``ip`` refuses."""
        NetworkPlan(1, tuple(nodes), mtu)  # bad input is refused before anything is made
        reason = missing_rights()
        if reason:
            raise NetworkUnavailable(reason)
        record = directory / RECORD
        remove_recorded(directory)  # a killed control plane's, if any
        start = random.SystemRandom().randrange(1 << 16)
        for octet in pick_octets(_machine_networks(), start)[:16]:
            plan = NetworkPlan(octet, tuple(nodes), mtu)
            # The bridge's name carries the octet: making it is what claims the /16 (another cluster starting
            # now gets "exists" and tries the next).
            made = _ip([f"link add {plan.bridge} type bridge"])
            if made.returncode != 0:
                if "exists" in made.stderr:
                    continue
                raise NetworkUnavailable(f"cannot make a bridge: {made.stderr.strip()}")
            record.write_text(json.dumps({"octet": octet, "nodes": nodes}))
            net = cls(plan, record)
            try:
                net._make()
            except (NetworkUnavailable, OSError, subprocess.SubprocessError) as exc:
                net.remove()
                raise NetworkUnavailable(str(exc)) from None
            return net
        raise NetworkUnavailable("no free 10.x.0.0/16 for the cluster's network (every candidate overlaps this "
                                 "machine's networks or another cluster's)")

    def _make(self) -> None:
        p = self.plan
        # addrgenmode none: no IPv6 link-local address either; the cluster's addresses are the plan's alone.
        # The bridge's own address first: the primary, so what this machine sends to a node comes from it and
        # not from the API server's or etcd's (which a cut may blackhole).
        host = [f"link set {p.bridge} addrgenmode none", f"link set {p.bridge} mtu {p.mtu}",
                f"addr add {p.bridge_ip}/{p.prefix} dev {p.bridge}",
                f"addr add {p.api_ip}/{p.prefix} dev {p.bridge}", f"addr add {p.etcd_ip}/{p.prefix} dev {p.bridge}",
                f"link set {p.bridge} up"]
        for node in p.nodes:
            host += [f"netns add {p.netns(node)}",
                     f"link add {p.host_veth(node)} mtu {p.mtu} type veth peer name eth0 mtu {p.mtu} "
                     f"netns {p.netns(node)}",
                     f"link set {p.host_veth(node)} addrgenmode none",
                     f"link set {p.host_veth(node)} master {p.bridge} up"]
        _checked(host)
        for node in p.nodes:
            _checked(["link set eth0 addrgenmode none", f"addr add {p.node_ip(node)}/{p.prefix} dev eth0",
                      "link set lo up", "link set eth0 up"], p.netns(node))

    def remove(self) -> None:
        """Remove every namespace, link and address the network made (what is already gone is skipped)."""
        remove_plan(self.plan)
        self.record.unlink(missing_ok=True)

    # --- pods' addresses ---------------------------------------------------------------------------------------

    def add_address(self, node: str, ip: str) -> None:
        """Put a pod's address on its node's ``eth0`` (before the pod's processes start, so they can bind it)."""
        result = _ip([f"addr replace {ip}/{self.plan.prefix} dev eth0"], self.plan.netns(node))
        if result.returncode != 0:
            raise OSError(f"cannot add {ip} to node {node}: {result.stderr.strip()}")
        self.addresses[node].add(ip)
        self._apply()

    def remove_address(self, node: str, ip: str) -> None:
        if ip not in self.addresses.get(node, set()):
            return
        self.addresses[node].discard(ip)
        _ip([f"addr del {ip}/{self.plan.prefix} dev eth0"], self.plan.netns(node))
        self._apply()

    # --- faults ------------------------------------------------------------------------------------------------

    def partition(self, cut: Cut) -> None:
        """Put ``cut`` in force (it replaces the node's earlier cut, if any)."""
        self.cuts[cut.node] = cut
        self._apply()

    def heal(self, node: str) -> Cut:
        """End the node's cut; KeyError when it has none."""
        cut = self.cuts.pop(node)
        self._apply()
        return cut

    def cut_from_api(self, node: str) -> bool:
        cut = self.cuts.get(node)
        return cut is not None and cut.cuts("api")

    def _apply(self) -> None:
        want = blocked(self.plan, self.cuts, self.addresses)
        if want == self._blocked:
            return
        by_place: dict[str, list[str]] = {}
        for place, ip in sorted(want - self._blocked):
            dev = self.plan.bridge if place == HOST else "eth0"
            by_place.setdefault(place, []).append(f"neigh replace {ip} lladdr {NOWHERE} dev {dev} nud permanent")
        for place, ip in sorted(self._blocked - want):
            dev = self.plan.bridge if place == HOST else "eth0"
            by_place.setdefault(place, []).append(f"neigh del {ip} dev {dev}")
        for place, lines in by_place.items():
            result = _ip(lines, None if place == HOST else self.plan.netns(place), force=True)
            # A deletion may find its entry already gone (its address was removed with it); a cut not made is
            # an error.
            if result.returncode != 0 and any(line.startswith("neigh replace") for line in lines):
                raise OSError(f"cannot change the neighbours of {place or 'the bridge'}: {result.stderr.strip()}")
        self._blocked = want

    # --- entering ----------------------------------------------------------------------------------------------

    def enter(self, node: str, hostname: str, hosts_file: Path) -> Callable[[], None]:
        """What a pod's process runs between fork and exec (see the module docstring)."""
        return entering(_NETNS_DIR / self.plan.netns(node), hostname, hosts_file)


def entering(netns_path: Path, hostname: str, hosts_file: Path) -> Callable[[], None]:
    """A preexec function: join the network namespace at ``netns_path``, then take a UTS and a mount namespace of
    the process's own with ``hostname`` and ``hosts_file`` as ``/etc/hosts``. It raises OSError in the child (the
    start then fails with it) where a step is refused."""
    name = hostname.encode()
    source, target = str(hosts_file).encode(), b"/etc/hosts"
    ns_path = str(netns_path)

    def run() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)

        def check(rc: int, what: str) -> None:
            if rc != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{what}: {os.strerror(err)}")

        fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check(libc.setns(fd, _CLONE_NEWNET), f"setns {ns_path}")
        finally:
            os.close(fd)
        check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS), "unshare")
        check(libc.sethostname(name, len(name)), "sethostname")
        # Private first: the bind below must not show in the machine's mount namespace.
        check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        check(libc.mount(source, target, None, _MS_BIND, None), "mount --bind /etc/hosts")

    return run


def hosts_text(ip: str, hostname: str) -> str:
    """A pod's ``/etc/hosts``: localhost, and its hostname at its IP."""
    return (f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{ip}\t{hostname}\n")


def remove_plan(plan: NetworkPlan) -> None:
    """Delete the host ends of the veth pairs (which takes the node ends with them, even while a socket still
    holds a namespace), the namespaces' names, and the bridge (with its addresses)."""
    lines = [f"link del {plan.host_veth(n)}" for n in plan.nodes]
    lines += [f"netns del {plan.netns(n)}" for n in plan.nodes]
    lines.append(f"link del {plan.bridge}")
    _ip(lines, force=True)


def remove_recorded(directory: Path) -> bool:
    """Remove the network ``<directory>/network.json`` records, if any (a cluster that was killed); returns
    whether there was one."""
    record = directory / RECORD
    try:
        data = json.loads(record.read_text())
        plan = NetworkPlan(int(data["octet"]), tuple(str(n) for n in data["nodes"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False
    if shutil.which("ip") is not None and os.geteuid() == 0:
        remove_plan(plan)
    with contextlib.suppress(FileNotFoundError):
        record.unlink()
    return True


def left_behind(plan: NetworkPlan) -> list[str]:
    """What of ``plan``'s network still exists: namespace names, links (for a test that ``down`` left nothing)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT,
                           check=False).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=_IP_TIMEOUT,
                           check=False).stdout
    ours = [plan.bridge, *(plan.host_veth(n) for n in plan.nodes)]
    found = [f"netns {n}" for n in (plan.netns(x) for x in plan.nodes) if n in names]
    for line in links.splitlines():
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0] in ours:
            found.append(f"link {parts[1].split('@')[0]}")
    addrs = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=_IP_TIMEOUT,
                           check=False).stdout
    found += [f"address {ip}" for ip in (plan.bridge_ip, plan.api_ip, plan.etcd_ip) if f" {ip}/" in addrs]
    return found
