"""The monitor keeps freeing the group's connections while an interrupt has not ended the training function."""

from __future__ import annotations

import socket
import threading
import time

from restart_helpers import new_job

from stalwart.etcd.store import Store
from stalwart.etcd.torch_store import EtcdTorchStore
from stalwart.local.etcd import EtcdServer
from stalwart.restart.coordination import Coordinator
from stalwart.restart.interrupt import Interrupter, RestartInterrupt
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.policies import IterationContext
from stalwart.restart.sockets import SocketSnapshot


def test_a_connection_opened_after_the_interrupt_is_shut_down_on_the_next_tick(etcd: EtcdServer,
                                                                               store: Store) -> None:
    # The real case: the main thread is inside a C call that connects to a peer whose process is paused (the
    # kernel accepts for it, nothing ever answers) when a new round takes over. The first shutdown finds no
    # connection to that peer yet; the one opened just after would hold the thread until the collective
    # timeout. Here the thread waits in C (a lock), and the connection is opened after the interrupt.
    keys, epoch = new_job(store)
    coord = Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=5, retry_for=10.0)
    torch_store = EtcdTorchStore(store, keys, epoch, scope="0/", timeout=10.0)
    ctx = IterationContext(iteration=0, slot=0, rank=0, world_size=2, store=torch_store,
                           keep_peers=((etcd.host, etcd.client_port),))
    listener = socket.create_server(("127.0.0.1", 0))
    ctx.group.sockets_before = SocketSnapshot()
    in_c = threading.Event()
    release = threading.Event()
    outcome: list[BaseException | None] = []
    made: list[Monitor] = []

    def training() -> None:
        # The interrupter belongs to the thread that runs the training function.
        interrupter = Interrupter()
        monitor = Monitor(coord, interrupter, soft_timeout=60.0, interval=0.05, status=StatusFile(None),
                          watch_main_thread=False)
        made.append(monitor)
        monitor.start()
        interrupter.enter_user_code()
        monitor.begin(0, ctx)
        try:
            in_c.set()
            release.wait(30)  # blocked in C: a pending interrupt fires only once this returns
            outcome.append(None)
        except RestartInterrupt as e:
            outcome.append(e)
        finally:
            interrupter.leave_user_code()
            monitor.end()

    t = threading.Thread(target=training)
    t.start()
    client: socket.socket | None = None
    try:
        assert in_c.wait(30)
        monitor = made[0]
        monitor._interrupt("round 2 (epoch 9) took over")
        assert monitor.interrupter.requested is not None and monitor.interrupter.in_user_code
        client = socket.create_connection(listener.getsockname(), timeout=5)
        server_side, _ = listener.accept()
        with server_side:
            server_side.settimeout(5)
            started = time.monotonic()
            assert server_side.recv(1) == b""  # end of stream: the new connection was shut down
            assert time.monotonic() - started < 2.0
    finally:
        release.set()
        t.join(30)
        for m in made:
            m.stop()
        if client is not None:
            client.close()
        listener.close()
        coord.stop()
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RestartInterrupt)
