"""The local cluster's network plan and the neighbour entries each network fault needs (pure: no namespace)."""

from __future__ import annotations

import pytest

from stalwart.local.netplan import (
    API,
    ETCD,
    HOST,
    OCTETS,
    Cut,
    NetworkPlan,
    PlanError,
    blocked,
    overlaps,
    parse_cut,
    pick_octets,
)

PLAN = NetworkPlan(200, ("local-0", "local-1", "local-2"))
#: Each node's pod addresses in the tables below.
PODS = {"local-0": ["10.200.1.2"], "local-1": ["10.200.2.2", "10.200.2.3"], "local-2": []}


def test_names_and_addresses_of_a_plan() -> None:
    assert (PLAN.subnet, PLAN.bridge_ip, PLAN.api_ip, PLAN.etcd_ip, PLAN.bridge) == (
        "10.200.0.0/16", "10.200.0.1", "10.200.0.2", "10.200.0.3", "stw200br")
    assert [PLAN.netns(n) for n in PLAN.nodes] == ["stalwart-200-0", "stalwart-200-1", "stalwart-200-2"]
    assert [PLAN.node_ip(n) for n in PLAN.nodes] == ["10.200.1.1", "10.200.2.1", "10.200.3.1"]
    assert PLAN.pod_ips("local-2")[0] == "10.200.3.2" and PLAN.pod_ips("local-2")[-1] == "10.200.3.254"
    assert len(PLAN.pod_ips("local-0")) == 253
    # Linux takes interface names of at most 15 characters.
    big = NetworkPlan(254, tuple(f"n{i}" for i in range(254)))
    assert max(len(big.host_veth(n)) for n in big.nodes) <= 15 and len(big.bridge) <= 15


@pytest.mark.parametrize(("ip", "node"), [
    ("10.200.2.7", "local-1"), ("10.200.1.1", "local-0"), ("10.200.0.1", None), ("10.200.9.1", None),
    ("10.201.1.2", None), ("127.0.0.1", None), ("nonsense", None),
])
def test_the_node_an_address_belongs_to(ip: str, node: str | None) -> None:
    assert PLAN.node_of(ip) == node


@pytest.mark.parametrize(("octet", "nodes", "message"), [
    (0, ("a",), "octet: expected 1 to 254"),
    (200, (), "nodes: expected 1 to 254 nodes"),
    (200, ("a", "a"), "nodes: names repeat"),
    (200, ("a", "etcd"), "name the control plane"),
])
def test_a_plan_refuses_what_cannot_be(octet: int, nodes: tuple[str, ...], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        NetworkPlan(octet, nodes)


@pytest.mark.parametrize(("mtu", "message"), [
    (1279, r"mtu: expected 1280 to 65535 \(a veth's largest\), got 1279"),
    (65536, r"mtu: expected 1280 to 65535 \(a veth's largest\), got 65536"),
])
def test_a_plan_refuses_an_mtu_no_link_takes(mtu: int, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        NetworkPlan(200, ("a",), mtu)
    assert NetworkPlan(200, ("a",), 1500).mtu == 1500
    assert NetworkPlan(200, ("a",)).mtu == 65535


@pytest.mark.parametrize(("octet", "networks", "expected"), [
    (200, ["192.0.2.0/24", "127.0.0.0/8"], False),
    (200, ["10.200.5.0/24"], True),
    (200, ["10.0.0.0/8"], True),
    (200, ["10.201.0.0/16", "10.199.3.4"], False),
    (200, ["10.200.0.9"], True),  # an address the machine has
    (200, ["0.0.0.0/0", "not-a-network", "fe80::/64"], False),  # a default route overlaps everything: not counted
])
def test_overlaps(octet: int, networks: list[str], expected: bool) -> None:
    assert overlaps(octet, networks) is expected


def test_octets_are_tried_from_the_drawn_start_and_skip_taken_networks() -> None:
    order = pick_octets(["10.161.0.0/16", "10.162.7.0/24"], start=0)
    assert order[:2] == [OCTETS[0], OCTETS[3]] and len(order) == len(OCTETS) - 2
    assert pick_octets([], start=len(OCTETS) - 1)[:2] == [OCTETS[-1], OCTETS[0]]


@pytest.mark.parametrize(("node", "from_", "expected"), [
    ("local-1", None, Cut("local-1")),
    ("local-1", "etcd", Cut("local-1", frozenset({ETCD}))),
    ("local-1", "api, etcd", Cut("local-1", frozenset({API, ETCD}))),
    ("local-1", "local-2", Cut("local-1", frozenset({"local-2"}))),
])
def test_parse_cut(node: str, from_: str | None, expected: Cut) -> None:
    assert parse_cut(PLAN, node, from_) == expected


@pytest.mark.parametrize(("node", "from_", "message"), [
    ("local-9", None, r"node: no node 'local-9'; nodes are \['local-0', 'local-1', 'local-2'\]"),
    ("local-1", "etcd,bogus", r"--from: 'bogus' is not api, etcd or a node \(local-0, local-1, local-2\)"),
    ("local-1", "etcd,", "--from: expected a comma-separated list"),
    ("local-1", "local-1", r"--from: a node cannot be cut from itself \('local-1'\)"),
])
def test_parse_cut_names_what_is_wrong(node: str, from_: str | None, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_cut(PLAN, node, from_)


def _ips(node: str) -> list[str]:
    return [PLAN.node_ip(node), *PODS[node]]


@pytest.mark.parametrize(("cut", "expected"), [
    # etcd or the API server: the node's side only (the machine's table cannot tell one's packets from the other's).
    (Cut("local-1", frozenset({ETCD})), {("local-1", "10.200.0.3")}),
    (Cut("local-1", frozenset({API})), {("local-1", "10.200.0.2")}),
    (Cut("local-1", frozenset({API, ETCD})), {("local-1", "10.200.0.2"), ("local-1", "10.200.0.3")}),
    # one peer: both sides, every address of each (InternalIP and pods).
    (Cut("local-1", frozenset({"local-0"})),
     {("local-1", ip) for ip in _ips("local-0")} | {("local-0", ip) for ip in _ips("local-1")}),
    # everything: the control plane, every peer, and the machine's side toward the node.
    (Cut("local-1"),
     {("local-1", "10.200.0.2"), ("local-1", "10.200.0.3")}
     | {("local-1", ip) for ip in _ips("local-0") + _ips("local-2")}
     | {(peer, ip) for peer in ("local-0", "local-2") for ip in _ips("local-1")}
     | {(HOST, ip) for ip in _ips("local-1")}),
])
def test_the_neighbour_entries_a_cut_needs(cut: Cut, expected: set[tuple[str, str]]) -> None:
    assert blocked(PLAN, {cut.node: cut}, PODS) == frozenset(expected)


def test_no_cut_needs_nothing_and_two_cuts_need_the_union() -> None:
    assert blocked(PLAN, {}, PODS) == frozenset()
    a, b = Cut("local-0", frozenset({ETCD})), Cut("local-2", frozenset({"local-1"}))
    assert blocked(PLAN, {"local-0": a, "local-2": b}, PODS) == (
        blocked(PLAN, {"local-0": a}, PODS) | blocked(PLAN, {"local-2": b}, PODS))


def test_a_pod_started_on_a_cut_off_peer_is_cut_off_too() -> None:
    cut = {"local-1": Cut("local-1", frozenset({"local-2"}))}
    before = blocked(PLAN, cut, PODS)
    after = blocked(PLAN, cut, {**PODS, "local-2": ["10.200.3.9"]})
    assert after - before == {("local-1", "10.200.3.9")}
