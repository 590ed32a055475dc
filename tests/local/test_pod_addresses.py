"""Pod addresses of the local cluster: each cluster hands out its own 127.<subnet>.x.y, or with a network per node
its nodes' 10.x.<node+1>.y (stalwart/local/podruns.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.local.netns import NodeNetwork
from stalwart.local.netplan import NetworkPlan
from stalwart.local.podruns import PodRuns


def test_each_cluster_has_its_own_pod_addresses_and_skips_the_reserved_ones() -> None:
    a, b = PodRuns(subnet=7), PodRuns(subnet=8)
    first = [a.free_ip() for _ in range(300)]
    assert first[:2] == ["127.7.0.2", "127.7.0.3"]
    assert all(ip.startswith("127.7.") and ip.rsplit(".", 1)[1] not in ("0", "1", "255") for ip in first)
    assert b.free_ip() == "127.8.0.2"  # another cluster on the same machine: no address in common
    assert a.free_ip(previous="127.7.9.9") == "127.7.9.9"  # a pod keeps its address when no one holds it


def test_a_random_subnet_is_picked_and_a_bad_one_is_refused_by_name() -> None:
    assert 1 <= PodRuns().subnet <= 254
    with pytest.raises(ValueError, match="subnet: expected 1 to 254"):
        PodRuns(subnet=0)


def test_with_a_network_per_node_a_pod_gets_one_of_its_nodes_addresses_round_robin(tmp_path: Path) -> None:
    plan = NetworkPlan(200, ("local-0", "local-1"))
    runs = PodRuns(network=NodeNetwork(plan, tmp_path / "network.json"))  # nothing made: free_ip only decides
    assert [runs.free_ip(node="local-1") for _ in range(3)] == ["10.200.2.2", "10.200.2.3", "10.200.2.4"]
    assert runs.free_ip(node="local-0") == "10.200.1.2"
    # A pod back on its node keeps its address; one that moved, or an address not a pod's, does not.
    assert runs.free_ip(previous="10.200.2.9", node="local-1") == "10.200.2.9"
    assert runs.free_ip(previous="10.200.2.9", node="local-0") == "10.200.1.3"
    assert runs.free_ip(previous="10.200.1.1", node="local-0") == "10.200.1.4"
    # The round wraps past .254.
    assert [runs.free_ip(node="local-1") for _ in range(251)][-2:] == ["10.200.2.254", "10.200.2.2"]
