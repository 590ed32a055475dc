"""The monitor keeps freeing the group's connections while a delivered interrupt has not ended the training
function, and leaves an atomic section alone."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from restart_helpers import new_job

from stalwart.api.exit_codes import ExitCode
from stalwart.etcd.store import Store
from stalwart.etcd.torch_store import EtcdTorchStore
from stalwart.local.etcd import EtcdServer
from stalwart.restart import monitor as monitor_module
from stalwart.restart import snapshot_held, snapshot_spill
from stalwart.restart.coordination import Coordinator
from stalwart.restart.interrupt import Interrupter, RestartInterrupt
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.monitor_rules import ABANDON_AFTER, SPILL_AFTER
from stalwart.restart.peers import TensorSpec
from stalwart.restart.policies import IterationContext
from stalwart.restart.sockets import SocketSnapshot


@dataclass
class Training:
    """A thread that runs a 'training function' waiting in C (a lock) until released, under a real monitor."""

    monitor: Monitor
    release: threading.Event
    outcome: list[BaseException | None] = field(default_factory=list)


@contextlib.contextmanager
def training_in_c(etcd: EtcdServer, store: Store, *, atomic: bool, status: str | None = None,
                  ended: list[int] | None = None) -> Iterator[Training]:
    keys, epoch = new_job(store)
    coord = Coordinator(store, keys, epoch, slot=0, node_id="node-0", lease_ttl=5, retry_for=10.0)
    torch_store = EtcdTorchStore(store, keys, epoch, scope="0/", timeout=10.0)
    ctx = IterationContext(iteration=0, slot=0, rank=0, world_size=2, store=torch_store,
                           keep_peers=((etcd.host, etcd.client_port),))
    ctx.group.sockets_before = SocketSnapshot()
    in_c, release = threading.Event(), threading.Event()
    made: list[Training] = []

    def run() -> None:
        # The interrupter belongs to the thread that runs the training function.
        interrupter = Interrupter()
        monitor = Monitor(coord, interrupter, soft_timeout=60.0, interval=0.05, status=StatusFile(status),
                          watch_main_thread=False, end_process=(ended if ended is not None else []).append)
        training = Training(monitor, release)
        made.append(training)
        monitor.start()
        interrupter.enter_user_code()
        monitor.begin(0, ctx)
        try:
            with interrupter.atomic() if atomic else contextlib.nullcontext():
                in_c.set()
                release.wait(30)  # blocked in C: a pending interrupt fires only once this returns
            training.outcome.append(None)
        except RestartInterrupt as e:
            training.outcome.append(e)
        finally:
            interrupter.leave_user_code()
            monitor.end()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert in_c.wait(30)
        yield made[0]
    finally:
        release.set()
        t.join(30)
        for m in made:
            m.monitor.stop()
        coord.stop()
    assert not t.is_alive()


def _connect(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server_side, _ = listener.accept()
    server_side.settimeout(5)
    return client, server_side


def test_a_connection_opened_after_the_interrupt_is_shut_down_on_the_next_tick(etcd: EtcdServer,
                                                                               store: Store) -> None:
    # The real case: the main thread is inside a C call that connects to a peer whose process is paused (the
    # kernel accepts for it, nothing ever answers) when a new round takes over. The first shutdown finds no
    # connection to that peer yet; the one opened just after would hold the thread until the collective
    # timeout. Here the thread waits in C, and the connection is opened after the interrupt.
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            training_in_c(etcd, store, atomic=False) as training:
        training.monitor._interrupt("round 2 (epoch 9) took over")
        assert training.monitor.interrupter.requested is not None and training.monitor.interrupter.in_user_code
        client, server_side = _connect(listener)
        with client, server_side:
            started = time.monotonic()
            assert server_side.recv(1) == b""  # end of stream: the new connection was shut down
            assert time.monotonic() - started < 2.0
    assert len(training.outcome) == 1 and isinstance(training.outcome[0], RestartInterrupt)


def test_an_atomic_section_keeps_the_connections_it_opens_until_it_ends(etcd: EtcdServer, store: Store) -> None:
    # An interrupt requested during an atomic section (a checkpoint upload) waits for the section's end: a
    # connection the section opens after the request is not shut down by the monitor's ticks.
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            training_in_c(etcd, store, atomic=True) as training:
        training.monitor._interrupt("fault in slot 1: exception")
        client, server_side = _connect(listener)
        with client, server_side:
            time.sleep(0.5)  # ten monitor ticks
            client.sendall(b"x")
            assert server_side.recv(1) == b"x"
            assert training.outcome == []
    assert len(training.outcome) == 1 and isinstance(training.outcome[0], RestartInterrupt)


def test_the_interrupt_is_requested_before_the_connections_are_freed(etcd: EtcdServer, store: Store,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Freeing the group's connections fails this process's own collective at once. The training thread then
    # asks whether an interrupt was requested: had the monitor not asked yet, the thread would take the failure
    # for its own fault and record an "exception" over the monitor's report (a hang would read as an exception).
    seen: list[str | None] = []
    free = monitor_module.free_blocked_peers

    def observed(ctx: IterationContext) -> int:
        seen.append(training.monitor.interrupter.requested)
        return free(ctx)

    monkeypatch.setattr(monitor_module, "free_blocked_peers", observed)
    with training_in_c(etcd, store, atomic=False) as training:
        training.monitor._interrupt("no progress for 3s")
        assert seen and seen[0] == "no progress for 3s"
    assert len(training.outcome) == 1 and isinstance(training.outcome[0], RestartInterrupt)



@pytest.fixture
def held() -> Iterator[dict[tuple[str, int, int], list[float]]]:
    """This process holds its own shard (0) and a ward's (1) at step 3, as a rank whose copies landed does."""
    import torch

    snapshot_held.forget()
    h = snapshot_held.HELD
    h.own_shard, h.world = 0, 2
    spec = [TensorSpec("model.w", (4,), "float32")]
    h.own[3] = snapshot_held.Copy(3, spec, {"float32": torch.arange(4.0)})
    h.wards[1] = {3: snapshot_held.Copy(3, spec, {"float32": torch.arange(4.0) + 10})}
    yield {("own", 0, 3): [0.0, 1.0, 2.0, 3.0], ("ward", 1, 3): [10.0, 11.0, 12.0, 13.0]}
    snapshot_held.forget()


def test_a_thread_still_blocked_after_its_interrupt_spills_what_it_holds_then_ends_the_process(
        etcd: EtcdServer, store: Store, tmp_path: Path, held: dict[tuple[str, int, int], list[float]]) -> None:
    # No interrupt frees a main thread held by a transfer gloo does not fail: what the process holds is written
    # where the process that takes its slot reads it, then the process ends itself for its agent to start that
    # one (here the ending is recorded, not done).
    status = tmp_path / "rank-0.json"
    spilled = snapshot_spill.directory_for(status)
    ended: list[int] = []
    with training_in_c(etcd, store, atomic=False, status=str(status), ended=ended) as training:
        interrupted = time.monotonic()
        training.monitor._interrupt("no progress for 3s")
        deadline = time.monotonic() + 20
        while not (spilled / "ward-1-3").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        written = time.monotonic() - interrupted
        assert ended == []  # written out first; a native call of a step may still return
        while not ended and time.monotonic() < deadline + 20:
            time.sleep(0.05)
        gone = time.monotonic() - interrupted
    copies = snapshot_spill.read(spilled)
    assert {(c.kind, c.shard, c.step): c.flats["float32"].tolist() for c in copies} == held
    assert written >= SPILL_AFTER  # not before the interrupt had its chance
    assert ended == [int(ExitCode.ABANDONED)] and gone >= ABANDON_AFTER


def test_a_thread_the_interrupt_frees_spills_nothing_and_lives_on(
        etcd: EtcdServer, store: Store, tmp_path: Path, held: dict[tuple[str, int, int], list[float]]) -> None:
    status = tmp_path / "rank-0.json"
    ended: list[int] = []
    with training_in_c(etcd, store, atomic=False, status=str(status), ended=ended) as training:
        training.monitor._interrupt("fault in slot 1: exception")
        training.release.set()  # the blocking call returns: the interrupt ends the function at once
        deadline = time.monotonic() + 10
        while not training.outcome and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(SPILL_AFTER + 0.5)  # the monitor ticks on, past the spill's delay
        assert not snapshot_spill.directory_for(status).exists() and ended == []
    assert len(training.outcome) == 1 and isinstance(training.outcome[0], RestartInterrupt)
