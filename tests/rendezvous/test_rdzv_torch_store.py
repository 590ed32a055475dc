"""The etcd torch Store: torch's Store semantics, epoch fencing, and gloo groups of real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from rdzv_helpers import JOIN_TIMEOUT, record

from stalwart.agent.rendezvous import EtcdTorchStore, RendezvousSettings, StaleEpoch
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreTimeout, StoreUnavailable
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("gloo_worker.py")


@pytest.fixture
def sealed(make_rdzv):
    """A one-node round: (handle, its RoundInfo)."""
    r = make_rdzv(RendezvousSettings(min_nodes=1, max_nodes=1, node_ttl=30))
    h = r.node(record("solo"))
    return h, h.join(timeout=JOIN_TIMEOUT)


def test_store_follows_torch_semantics(sealed) -> None:
    h, _ = sealed
    s = h.torch_store(timeout=5)
    s.set("k", b"v1")
    assert s.get("k") == b"v1"
    assert s.add("counter", 3) == 3 and s.add("counter", -1) == 2 and s.get("counter") == b"2"
    assert s.compare_set("cas", "", "first") == b"first"  # absent, expected empty: set
    assert s.compare_set("cas", "wrong", "x") == b"first"  # mismatch: current value back
    assert s.compare_set("cas", "first", "second") == b"second"
    assert s.compare_set("absent", "something", "x") == b"something"  # absent, not set
    assert not s.check(["absent"]) and s.check(["k", "cas"])
    assert s.num_keys() == 3
    assert s.delete_key("k") and not s.delete_key("k")
    s.multi_set(["m1", "m2"], [b"1", b"2"])
    assert s.multi_get(["m1", "m2"]) == [b"1", b"2"]
    many = [f"many/{i}" for i in range(250)]  # more than one etcd transaction holds
    s.multi_set(many, [str(i).encode() for i in range(250)])
    s.wait(many, timedelta(seconds=30))
    assert s.get("many/249") == b"249"
    s.append("log", b"a")
    s.append("log", b"b")
    assert s.get("log") == b"ab"
    with pytest.raises(dist.DistStoreError, match="timed out"):
        s.wait(["never"], timedelta(seconds=0.5))
    with pytest.raises(ValueError, match="decimal integer"):
        s.add("log", 1)


def test_wait_returns_when_another_writer_sets_the_keys(sealed) -> None:
    h, _ = sealed
    s = h.torch_store(timeout=30)
    writer = threading.Thread(target=lambda: [s.set(f"w{i}", b"x") for i in range(3)])
    writer.start()
    s.wait(["w0", "w1", "w2"])
    writer.join(10)
    assert s.get("w2") == b"x"


def test_a_stale_epoch_store_is_refused(sealed) -> None:
    h, first = sealed
    old = h.torch_store(timeout=30)
    old.set("before", b"ok")
    h.request_rerendezvous("test")
    assert h.wait_round_end(60) is not None
    second = h.join(timeout=JOIN_TIMEOUT)
    new = h.torch_store(timeout=30)
    assert new.prefix != old.prefix and new.num_keys() == 0  # a fresh namespace per epoch
    with pytest.raises(StaleEpoch) as err:
        old.set("after", b"zombie")
    assert err.value.epoch == first.epoch and err.value.current == second.epoch
    with pytest.raises(StaleEpoch):
        old.wait(["never"], timedelta(seconds=30))
    with pytest.raises(StaleEpoch):
        old.check(["before"])


def run_workers(endpoint: str, keys: JobKeys, ranks: list[tuple[int, int]], world: int,
                tmp: Path) -> list[dict[str, object]]:
    """Start one process per (epoch, rank); return what each reported."""
    procs = []
    for epoch, rank in ranks:
        out = tmp / f"rank{rank}-{epoch}.json"
        cmd = [sys.executable, str(WORKER), endpoint, keys.namespace, keys.uid, str(epoch), str(rank),
               str(world), str(out)]
        procs.append((subprocess.Popen(cmd), out))
    results = []
    for p, out in procs:
        p.wait(timeout=240)
        results.append(json.loads(out.read_text()))
    return results


def test_gloo_group_of_four_processes_bootstraps_through_etcd_and_a_stale_one_is_refused(
        sealed, etcd: EtcdServer, job_keys: JobKeys, tmp_path: Path) -> None:
    h, first = sealed
    h.request_rerendezvous("new round for the group")
    assert h.wait_round_end(60) is not None
    second = h.join(timeout=JOIN_TIMEOUT)
    # Four ranks of the current round, and a fifth process still holding the old epoch.
    ranks = [(second.epoch, r) for r in range(4)] + [(first.epoch, 0)]
    results = run_workers(etcd.endpoint, job_keys, ranks, 4, tmp_path)
    current, stale = results[:4], results[4]
    assert [r.get("sum") for r in current] == [10.0] * 4, current
    assert "StaleEpoch" in str(stale.get("error")), stale


def test_store_calls_fail_cleanly_when_etcd_is_down(private_etcd: EtcdServer) -> None:
    etcd = Store([private_etcd.endpoint], timeout=1.0)
    try:
        s = EtcdTorchStore.unfenced(etcd, "/test/unfenced/", timeout=2)
        s.set("a", b"1")
        private_etcd.stop()
        with pytest.raises((StoreUnavailable, StoreTimeout)):
            s.set("b", b"2")
        private_etcd.start()
    finally:
        etcd.close()
