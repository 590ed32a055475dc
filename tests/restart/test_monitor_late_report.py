"""A hang seen in one iteration and reported late does not interrupt the next one.

Seen under load in the two-rank hang test: rank 0's monitor saw its collective stall (rank 1 hung) and began
writing its soft-timeout report; etcd was slow. Meanwhile rank 1's own report interrupted rank 1, whose closed
connections freed rank 0, and both went on to the next iteration. Rank 0's monitor then finished writing and
interrupted what was running by then: the next iteration, inside its group's construction. Rank 1, waiting
there in native code for rank 0's connection, could not be freed and ended itself as ABANDONED; the job lost a
rank for a hang it had already recovered from. Here the report's write is held until the main thread has
entered the next iteration, and that iteration must run to its end.
"""

from __future__ import annotations

import threading

from restart_helpers import new_job

from stalwart.api.restart import FaultRecord
from stalwart.etcd.store import Store
from stalwart.etcd.torch_store import EtcdTorchStore
from stalwart.restart.coordination import Coordinator
from stalwart.restart.interrupt import Interrupter, RestartInterrupt
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.policies import IterationContext


def test_a_report_written_after_the_next_iteration_began_does_not_interrupt_it(store: Store) -> None:
    keys, epoch = new_job(store)
    coord = Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=5, retry_for=10.0)
    write = coord.report_fault
    reporting, moved_on, written = threading.Event(), threading.Event(), threading.Event()

    def slow_report(rec: FaultRecord) -> bool:
        reporting.set()
        assert moved_on.wait(30)  # etcd answers only once the main thread is in the next iteration
        ok = write(rec)
        written.set()
        return ok

    coord.report_fault = slow_report  # type: ignore[method-assign]
    outcomes: dict[int, str] = {}
    failed: list[BaseException] = []

    def contexts(iteration: int) -> IterationContext:
        return IterationContext(iteration=iteration, slot=0, rank=0, world_size=2,
                                store=EtcdTorchStore(store, keys, epoch, scope=f"{iteration}/", timeout=10.0))

    def run() -> None:
        interrupter = Interrupter()
        # Soft timeout 0.3 s once pinged; 30 s before the first ping (iteration 1 never pings).
        monitor = Monitor(coord, interrupter, soft_timeout=0.3, startup_timeout=30.0, interval=0.05,
                          status=StatusFile(None), watch_main_thread=False, end_process=lambda code: None)
        monitor.start()
        try:
            for iteration in (0, 1):
                interrupter.enter_user_code()
                monitor.begin(iteration, contexts(iteration))
                try:
                    if iteration == 0:
                        monitor.ping(1)
                        # Blocked until the monitor has seen the stall and is writing its report; then a
                        # peer's closed connection frees this thread (the call returns) and the iteration ends.
                        assert reporting.wait(30)
                    else:
                        moved_on.set()
                        written.wait(30)  # the late report lands while this iteration runs...
                        threading.Event().wait(1.0)  # ... and the monitor ticks on twenty times
                    outcomes[iteration] = "returned"
                except RestartInterrupt:
                    outcomes[iteration] = "interrupted"
                finally:
                    interrupter.leave_user_code()
                    monitor.end()
        except BaseException as e:  # shown by the test's assertion, not lost in the thread
            failed.append(e)
        finally:
            monitor.stop()

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    coord.stop()
    assert not t.is_alive() and failed == []
    assert written.is_set()
    assert outcomes == {0: "returned", 1: "returned"}
    # The report itself went in, for the iteration it is about.
    [(key, value)] = [(kv.key, kv.value) for kv in store.get_prefix(keys.prefix)[0] if "/fault/" in kv.key]
    assert FaultRecord.from_json_bytes(value).iteration == 0 and FaultRecord.from_json_bytes(value).kind == \
        "soft_timeout", key
