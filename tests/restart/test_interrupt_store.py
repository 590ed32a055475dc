"""An interrupt never lands inside the etcd client: the iteration's torch Store is shielded from it.

The wrapper builds each iteration's process group inside the interruptible region (a peer's fault must be able
to stop a build that waits for it), and the group talks to etcd through the Store. An asynchronous exception
raised inside gRPC's Python code can leave one of its locks held (it lands between a lock's acquire and the
``with`` that would release it), and every later call on that channel then deadlocks: a rank that hung at its
job's end in CI. Here a thread requests interrupts at random moments while another runs Store calls in "user
code", over and over; the calls and a fresh call after them must all end.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from restart_helpers import new_job

from stalwart.etcd.store import Store
from stalwart.etcd.torch_store import EtcdTorchStore
from stalwart.local.etcd import EtcdServer
from stalwart.restart.interrupt import Interrupter, RestartInterrupt

pytestmark = pytest.mark.integration

CHURN_SECONDS = 6.0
ENDS_WITHIN = 30.0


class Churn:
    """Store calls in user code on one thread (the interrupter's), interrupts requested from another."""

    def __init__(self, store: EtcdTorchStore) -> None:
        self.store = store
        self.interrupted = 0
        self.calls = 0
        self.other: list[BaseException] = []
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.interrupter: Interrupter | None = None

    def work(self) -> None:
        it = self.interrupter = Interrupter()  # targets this thread
        self.store.shield = it  # as the wrapper sets it
        self.ready.set()
        deadline = time.monotonic() + CHURN_SECONDS
        try:
            while time.monotonic() < deadline:
                try:
                    try:
                        # Inside the try whose finally leaves, as the wrapper calls it: an interrupt requested the
                        # moment the function is entered may land on the way out of enter_user_code.
                        it.enter_user_code()
                        while True:
                            self.calls += 1
                            key = f"k{self.calls % 8}"
                            self.store.set(key, b"v")
                            self.store.get(key)
                            self.store.add("count", 1)
                            self.store.wait(["k0"], timedelta(seconds=5))
                    finally:
                        it.leave_user_code()
                except RestartInterrupt:
                    self.interrupted += 1
                except dist.DistStoreError as e:
                    self.other.append(e)
        finally:
            self.stop.set()

    def request(self) -> None:
        self.ready.wait(ENDS_WITHIN)
        it = self.interrupter
        assert it is not None
        rng = random.Random(7)
        while not self.stop.is_set():
            if it.in_user_code:
                it.request("test")
                it.nudge()
            time.sleep(rng.uniform(0, 0.004))


def run_churn(etcd: EtcdServer) -> tuple[Churn, bool, bool]:
    """Churn for a few seconds; then whether the churn thread ended, and whether a fresh call on the same
    channel ended (each within ENDS_WITHIN). A deadlocked channel is left open: closing it would hang too."""
    etcd_store = Store([etcd.endpoint], timeout=5)
    keys, epoch = new_job(etcd_store)
    churn = Churn(EtcdTorchStore(etcd_store, keys, epoch, timeout=10))
    worker = threading.Thread(target=churn.work, daemon=True)
    requester = threading.Thread(target=churn.request, daemon=True)
    worker.start()
    requester.start()
    worker.join(CHURN_SECONDS + ENDS_WITHIN)
    churn.stop.set()
    requester.join(ENDS_WITHIN)
    fresh_done = threading.Event()

    def fresh() -> None:
        etcd_store.put(keys.prefix + "after", b"1")
        fresh_done.set()

    threading.Thread(target=fresh, daemon=True).start()
    ended, fresh_ended = not worker.is_alive(), fresh_done.wait(ENDS_WITHIN)
    if ended and fresh_ended:
        etcd_store.close()
    return churn, ended, fresh_ended


def test_interrupts_never_land_inside_the_etcd_client(etcd: EtcdServer) -> None:
    churn, ended, fresh = run_churn(etcd)
    assert ended and fresh, f"deadlocked after {churn.calls} calls and {churn.interrupted} interrupts"
    assert churn.interrupted >= 20, churn.interrupted  # the interrupts did arrive, over and over
    # A shielded call that sees an interrupt waiting gives up with DistStoreError, replaced by the interrupt at
    # the shield's end; a DistStoreError reaching the caller would mean the interrupt was lost.
    assert churn.other == []


def test_a_shielded_wait_gives_up_for_a_pending_interrupt_which_is_raised_at_the_shields_end(
        etcd: EtcdServer) -> None:
    with Store([etcd.endpoint], timeout=5) as etcd_store:
        keys, epoch = new_job(etcd_store)
        store = EtcdTorchStore(etcd_store, keys, epoch, timeout=60)
        it = Interrupter()
        store.shield = it
        requester = threading.Timer(0.3, it.request, args=("a peer failed",))
        it.enter_user_code()
        try:
            requester.start()
            with pytest.raises(RestartInterrupt) as raised:
                store.wait(["never"], timedelta(seconds=60))
        finally:
            it.leave_user_code()
            requester.join(ENDS_WITHIN)
            it.close()
        # Raised by the shield as the wait ended (the wait's own error is its context), not inside the client.
        assert isinstance(raised.value.__context__, dist.DistStoreError), raised.value.__context__
        assert "interrupted" in str(raised.value.__context__)
        assert not requester.is_alive()
