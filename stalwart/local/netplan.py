"""The local cluster's network, as decisions over frozen records: which names and addresses a cluster with a network
per node uses (:class:`NetworkPlan`), and which addresses each place must stop reaching for the network faults in
force (:func:`blocked`). :mod:`.netns` carries them out with ``ip``.

Layout, for the cluster's own ``10.<octet>.0.0/16`` (an octet no route or address of the machine overlaps):

- a bridge in the machine's network namespace with three addresses: its own (``10.<octet>.0.1``, the source of
  what this machine sends to the nodes otherwise: the kubelet's probes, a test's connections), the API server's
  (``10.<octet>.0.2``) and etcd's (``10.<octet>.0.3``). It is the only place both this machine's tools and the
  nodes reach;
- node ``i`` (``local-i``): a network namespace joined to the bridge by a veth pair (``eth0`` inside; every link at
  :data:`MTU`), its
  InternalIP ``10.<octet>.<i+1>.1`` and the IPs of its pods, ``10.<octet>.<i+1>.2`` to ``.254``, all on that
  ``eth0``. No namespace has a default route, and the machine forwards nothing: the addresses reach each other
  and nothing else.

A fault cuts a node off from some of these addresses: its kernel keeps a permanent neighbour entry for each of
them that names a MAC no interface has (:data:`NOWHERE`), so what it sends there leaves on the wire and nobody
takes it. That is a silent loss, as on a cut link: a connection neither fails nor closes, it times out. Where the
cut is between two nodes, or between a node and everything, both sides get the entries (each side's sends are
lost); a cut from etcd or from the API server is made on the node's side only, since the machine's neighbour
table cannot tell the API server's packets from etcd's (both are on the bridge): what the node sends to the one
is lost, so no request of it reaches there and no answer comes back.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The targets of a cut that are not nodes.
API = "api"
ETCD = "etcd"
#: The neighbour table's key for the machine's own namespace (where the bridge, etcd and the API server are).
HOST = ""
#: A locally administered unicast MAC that no interface is given: frames sent to it are lost.
NOWHERE = "02:00:5e:00:de:ad"
#: The MTU of the bridge and of both ends of every veth pair: loopback's (65536, beyond a veth's 65535) rather
#: than Ethernet's 1500. The nodes are processes of one machine; at 1500 the kernel does in software, per packet,
#: what a real NIC's segmentation and receive offloads do in hardware: a copy between two nodes ran at 0.65-0.71
#: times its rate over loopback, where the anchors' processes (torchft's replica groups, torchrun's ranks) talk,
#: and at 0.81-0.92 times at 65535 (bench/link_mtu.py; docs/design.md, the local cluster's network).
MTU = 65535
#: The smallest MTU a plan takes (IPv6's minimum: below it some of the stack refuses the link).
MIN_MTU = 1280
#: The second octets the cluster's /16 is drawn from: well inside 10/8, away from the ranges clusters and
#: container engines like to take (10.0/16, 10.96/12 for services, 10.244/16 for pods).
OCTETS = tuple(range(160, 240))
#: Addresses of one node's pods: 10.<octet>.<node+1>.2 to .254.
FIRST_POD_HOST = 2
LAST_POD_HOST = 254
#: The most nodes a plan addresses (each takes one /24 of the /16, the first /24 is the control plane's).
MAX_NODES = 254


class PlanError(ValueError):
    """A plan or a cut was asked for with input that cannot be: the message names the argument."""


@dataclass(frozen=True)
class NetworkPlan:
    """The names and addresses of a cluster network: ``octet`` is the second octet of its 10.x/16, ``nodes`` the
    node names in order (node ``i`` gets the ``i+1``-th /24), ``mtu`` its links' MTU."""

    octet: int
    nodes: tuple[str, ...]
    #: The MTU of every link the plan makes (:data:`MTU` unless a benchmark compares others).
    mtu: int = MTU

    def __post_init__(self) -> None:
        if not 1 <= self.octet <= 254:
            raise PlanError(f"octet: expected 1 to 254, got {self.octet}")
        if not MIN_MTU <= self.mtu <= MTU:
            raise PlanError(f"mtu: expected {MIN_MTU} to {MTU} (a veth's largest), got {self.mtu}")
        if not 1 <= len(self.nodes) <= MAX_NODES:
            raise PlanError(f"nodes: expected 1 to {MAX_NODES} nodes, got {len(self.nodes)}")
        if len(set(self.nodes)) != len(self.nodes):
            raise PlanError(f"nodes: names repeat in {list(self.nodes)}")
        if {API, ETCD} & set(self.nodes):
            raise PlanError(f"nodes: {API!r} and {ETCD!r} name the control plane, not a node")

    @property
    def subnet(self) -> str:
        return f"10.{self.octet}.0.0/16"

    @property
    def prefix(self) -> int:
        return 16

    @property
    def bridge_ip(self) -> str:
        """The bridge's own address (its first: what this machine's connections to the nodes come from)."""
        return f"10.{self.octet}.0.1"

    @property
    def api_ip(self) -> str:
        return f"10.{self.octet}.0.2"

    @property
    def etcd_ip(self) -> str:
        return f"10.{self.octet}.0.3"

    @property
    def bridge(self) -> str:
        """The bridge's interface name (at most 15 characters, as Linux requires)."""
        return f"stw{self.octet}br"

    def index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise PlanError(f"node: no node {node!r}; nodes are {list(self.nodes)}") from None

    def netns(self, node: str) -> str:
        """The name of the node's network namespace (``ip netns``)."""
        return f"stalwart-{self.octet}-{self.index(node)}"

    def host_veth(self, node: str) -> str:
        """The machine's end of the node's veth pair (on the bridge); the node's end is ``eth0``."""
        return f"stw{self.octet}v{self.index(node)}"

    def node_ip(self, node: str) -> str:
        """The node's InternalIP."""
        return f"10.{self.octet}.{self.index(node) + 1}.1"

    def pod_ips(self, node: str) -> list[str]:
        """Every address a pod of ``node`` may have, in the order they are handed out."""
        third = self.index(node) + 1
        return [f"10.{self.octet}.{third}.{h}" for h in range(FIRST_POD_HOST, LAST_POD_HOST + 1)]

    def node_of(self, ip: str) -> str | None:
        """The node whose /24 holds ``ip``; None for the control plane's addresses and foreign ones."""
        parts = ip.split(".")
        if len(parts) != 4 or parts[:2] != ["10", str(self.octet)] or not parts[2].isdigit():
            return None
        i = int(parts[2]) - 1
        return self.nodes[i] if 0 <= i < len(self.nodes) else None


def overlaps(octet: int, networks: Iterable[str]) -> bool:
    """Whether ``10.<octet>.0.0/16`` overlaps any of ``networks`` (CIDRs or addresses the machine routes or has)."""
    ours = ipaddress.ip_network(f"10.{octet}.0.0/16")
    for text in networks:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            continue
        if net.version == 4 and net.prefixlen > 0 and ours.overlaps(net):
            return True
    return False


def pick_octets(networks: Iterable[str], start: int) -> list[int]:
    """The octets of :data:`OCTETS` whose /16 overlaps none of ``networks``, beginning at index ``start`` (drawn at
    random by the caller, so that two clusters starting together try different ones first)."""
    taken = list(networks)
    n = len(OCTETS)
    order = [OCTETS[(start + k) % n] for k in range(n)]
    return [o for o in order if not overlaps(o, taken)]


@dataclass(frozen=True)
class Cut:
    """A network fault in force on ``node``: cut from every address of ``targets`` (``api``, ``etcd``, node
    names); ``targets`` empty means from everything."""

    node: str
    targets: frozenset[str] = frozenset()

    @property
    def full(self) -> bool:
        return not self.targets

    def cuts(self, target: str) -> bool:
        return self.full or target in self.targets

    def describe(self) -> str:
        return "everything" if self.full else ", ".join(sorted(self.targets))


def parse_cut(plan: NetworkPlan, node: str, from_: str | None) -> Cut:
    """The cut ``stalwart local partition NODE [--from T,...]`` asks for; :class:`PlanError` naming the argument
    when the node or a target is not one of the cluster's."""
    if node not in plan.nodes:
        raise PlanError(f"node: no node {node!r}; nodes are {list(plan.nodes)}")
    if from_ is None:
        return Cut(node)
    targets = [t.strip() for t in from_.split(",")]
    if not all(targets):
        raise PlanError(f"--from: expected a comma-separated list of {API}, {ETCD} or node names, got {from_!r}")
    known = {API, ETCD, *plan.nodes}
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise PlanError(f"--from: {', '.join(map(repr, unknown))} is not {API}, {ETCD} or a node "
                        f"({', '.join(plan.nodes)})")
    if node in targets:
        raise PlanError(f"--from: a node cannot be cut from itself ({node!r})")
    return Cut(node, frozenset(targets))


def blocked(plan: NetworkPlan, cuts: Mapping[str, Cut],
            addresses: Mapping[str, Iterable[str]]) -> frozenset[tuple[str, str]]:
    """The neighbour entries to :data:`NOWHERE` the cuts need, as ``(place, ip)``: ``place`` is a node (its
    namespace) or :data:`HOST` (the bridge). ``addresses``: each node's addresses now (InternalIP and pod IPs).
    See the module docstring for which side of a cut gets what."""
    out: set[tuple[str, str]] = set()

    def ips(node: str) -> list[str]:
        return [plan.node_ip(node), *addresses.get(node, ())]

    for node, cut in cuts.items():
        if cut.cuts(API):
            out.add((node, plan.api_ip))
        if cut.cuts(ETCD):
            out.add((node, plan.etcd_ip))
        if cut.full:
            out.update((HOST, ip) for ip in ips(node))
        for peer in plan.nodes:
            if peer != node and cut.cuts(peer):
                out.update((node, ip) for ip in ips(peer))
                out.update((peer, ip) for ip in ips(node))
    return frozenset(out)
