"""Pod addresses of the local cluster: each cluster hands out its own 127.<subnet>.x.y (stalwart/local/podruns.py)."""

from __future__ import annotations

import pytest

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
