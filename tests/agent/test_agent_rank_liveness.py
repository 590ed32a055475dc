"""The ranks' liveness on their pod's lease, through a real agent and its real ranks on a real etcd: the ranks'
alive keys share the one lease their agent lends, and a rank that stops (SIGSTOP) loses its alive key when its
status file has gone unwritten for the lease's TTL, so its peer restarts without it long before the agent's kill."""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_agent import TIMEOUT, results, start_agent  # puts tests/restart on the path

from restart_helpers import expected_checksum, restart_records  # isort: skip

from stalwart.etcd.keys import NODES
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

#: The ranks' heartbeat TTL (their default).
TTL = 10.0


@pytest.mark.integration
def test_a_stopped_ranks_alive_key_goes_at_the_ttl_while_the_pods_lease_lives_on(etcd: EtcdServer,
                                                                                   tmp_path: Any) -> None:
    # Rank 1 stops itself (SIGSTOP) at step 3. With a soft timeout of 20 s its agent kills it only 20 s later,
    # and the pod's lease, kept alive by the agent, never ends: only the agent, which sees rank 1's status file
    # unwritten for the TTL, can end its liveness. Rank 0 then reports it lost, some 10 s before the kill.
    agent, keys = start_agent(etcd, tmp_path, "--steps", "8", "--fault", "sigstop", "--fault-step", "3",
                              "--soft-timeout", "20")
    leases: dict[str, int] = {}
    node_leases: set[int] = set()
    with Store([etcd.endpoint]) as store:
        deadline = time.monotonic() + 60
        while len(leases) < 2 and time.monotonic() < deadline and agent.poll() is None:
            kvs, _ = store.get_prefix(keys.restart)
            leases = {kv.key.rsplit("/", 1)[1]: kv.lease for kv in kvs if "/alive/" in kv.key}
            node_leases = {kv.lease for kv in store.get_prefix(keys.rendezvous + NODES)[0]}
            time.sleep(0.2)
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    # Both ranks' alive keys were bound to one lease, their pod's: the one its node key is on (the job's lease
    # TTL and the ranks' heartbeat TTL are both the default 10 s), the pod's only lease.
    assert sorted(leases) == ["0", "1"] and len(set(leases.values())) == 1 and 0 not in leases.values(), leases
    assert set(leases.values()) == node_leases, (leases, node_leases)
    assert "the ranks' liveness is on the pod's rendezvous lease" in err
    stopped = float((tmp_path / "fault-0").read_text())
    assert "local rank 1 (slot 1, pid" in err and "alive key removed: no status written for" in err, err[-3000:]
    faults = restart_records(etcd, keys, "fault")
    lost = faults["0/0"]
    assert (lost["kind"], lost["lostSlots"]) == ("peer_lost", [1]), faults
    # At the TTL after the stop, give or take the status reads (every 0.5 s) and the agent's poll; the kill at
    # the soft timeout came well after.
    assert TTL - 0.5 <= lost["time"] - stopped <= TTL + 4, (lost["time"] - stopped)
    killed = faults["0/1"]
    assert killed["kind"] == "stopped" and killed["time"] - stopped >= 20 - 1
    reference = expected_checksum(steps=8)
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert all(r["step"] == 8 and r["checksum"] == pytest.approx(reference, abs=1e-6) for r in res)
