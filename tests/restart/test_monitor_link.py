"""The end of a cut link that a peer's hang interrupts says the link is down when its own connections hold
bytes retransmitted unacknowledged (a one-peer cut is seen from whichever end had bytes in flight; the end whose
soft timeout fires first may have had every byte acknowledged). The monitor runs for real on a real etcd; only
the kernel's TCP table is stood in for (its reading is tested on rows in test_sockets.py): a cut that leaves
bytes in flight needs a network this test does not make."""

from __future__ import annotations

import threading
import time

import pytest
from restart_helpers import new_job

from stalwart.api.restart import FaultRecord
from stalwart.etcd.store import Store
from stalwart.etcd.torch_store import EtcdTorchStore
from stalwart.restart import monitor as monitor_module
from stalwart.restart.coordination import Coordinator
from stalwart.restart.interrupt import Interrupter, RestartInterrupt
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.policies import IterationContext
from stalwart.restart.sockets import SocketSnapshot

FAR = "10.0.0.1:40001"


@pytest.mark.parametrize("in_flight", [[FAR], []], ids=["retransmitting", "all-acknowledged"])
def test_the_interrupted_end_reports_the_link_its_bytes_could_not_cross(
        store: Store, monkeypatch: pytest.MonkeyPatch, in_flight: list[str]) -> None:
    keys, epoch = new_job(store)
    coord = Coordinator(store, keys, epoch, slot=1, node_id="node-1", lease_ttl=5, retry_for=10.0)
    peer = Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=5, retry_for=10.0)
    asked: list[SocketSnapshot] = []

    def retransmitting(before: SocketSnapshot) -> list[str]:
        asked.append(before)
        return list(in_flight)

    monkeypatch.setattr(monitor_module, "retransmitting", retransmitting)
    ctx = IterationContext(iteration=0, slot=1, rank=1, world_size=2,
                           store=EtcdTorchStore(store, keys, epoch, scope="0/", timeout=10.0))
    ctx.group.sockets_before = SocketSnapshot()
    outcome: list[str] = []
    running = threading.Event()

    def run() -> None:
        interrupter = Interrupter()  # it interrupts the thread that made it
        # A soft timeout far beyond the test: only the peer's report can interrupt this process.
        monitor = Monitor(coord, interrupter, soft_timeout=60.0, startup_timeout=60.0, interval=0.05,
                          status=StatusFile(None), watch_main_thread=False, end_process=lambda code: None)
        monitor.start()
        try:
            interrupter.enter_user_code()
            monitor.begin(0, ctx)
            try:
                monitor.ping(1)
                running.set()
                for _ in range(300):  # Python between short waits: where an interrupt of this thread lands
                    time.sleep(0.1)
                outcome.append("returned")
            except RestartInterrupt:
                outcome.append("interrupted")
            finally:
                interrupter.leave_user_code()
                monitor.end()
        finally:
            monitor.stop()

    main = threading.Thread(target=run)
    main.start()
    try:
        assert running.wait(30)
        peer.report_fault(FaultRecord(slot=0, rank=0, node_id="node-0", iteration=0, kind="soft_timeout",
                                      reason="no progress for 5.1s (soft timeout 5s)", time=1.0))
        main.join(30)
    finally:
        coord.stop()
        peer.stop()
    assert not main.is_alive() and outcome == ["interrupted"]
    assert asked == [ctx.group.sockets_before]  # read once, for the iteration's own connections
    records = {FaultRecord.from_json_bytes(kv.value).slot: FaultRecord.from_json_bytes(kv.value)
               for kv in store.get_prefix(keys.prefix)[0] if "/fault/" in kv.key}
    if not in_flight:
        assert set(records) == {0}  # nothing to say about the link: the peer's hang stands alone
        return
    mine = records[1]
    assert (mine.kind, mine.iteration, mine.rank, mine.unreachable) == ("link_down", 0, 1, [FAR])
    assert "slot 0" in mine.reason and FAR in mine.reason
