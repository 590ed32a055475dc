"""A process of stalwart's that has decided to exit is gone within a bound (stalwart/exits.py).

The deadlock these tests reproduce is the one seen at a finished job's exit: a gRPC streaming call collected
while a daemon thread holds the call's condition lock waits for that lock for ever (``_Rendezvous.__del__``).
Each test runs a real process against the real etcd and the real gRPC client, and each process is shown to end
(killed at the end of the test if it did not end by itself, and that counted as the failure it is)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import exits
from stalwart.agent.processes import RankProcesses
from stalwart.api.restart import RankStatus
from stalwart.etcd.store import Store, StoreError
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

#: Scheduling slack on a loaded two-core machine, beyond the bound the code itself promises.
SLACK = 5.0

#: A process with a live streaming call (a lease keep-alive stream, as the keep-alive thread used to leave
#: behind) whose condition a daemon thread holds, as gRPC's own delivery thread does while it hands an event
#: over. Its main function then returns, dropping the call's last reference: the call's __del__ waits on the
#: condition. MODE "plain" exits as every process did before; "leave" as the agent's and operator's main do now.
SCRIPT = textwrap.dedent('''
    import logging, queue, sys, threading, time
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from pyetcd.etcdrpc import rpc_pb2 as rpc
    from stalwart import exits
    from stalwart.etcd.store import Store

    def main(endpoint: str, mode: str) -> int:
        store = Store([endpoint])
        lease = store.lease_grant(30, keepalive=False)
        requests: queue.Queue = queue.Queue()
        def request_stream():
            while (r := requests.get()) is not None:
                yield r
        stream = store._members.current().lease.LeaseKeepAlive(request_stream())
        requests.put(rpc.LeaseKeepAliveRequest(ID=lease))
        next(stream)
        held = threading.Event()
        def hold(condition):
            with condition:
                held.set()
                time.sleep(3600)
        threading.Thread(target=hold, args=(stream._state.condition,), daemon=True).start()
        assert held.wait(5)
        if mode == "leave":
            exits.decided(4, bound=BOUND)  # as the agent does once its ranks are gone
        print("returning", flush=True)
        return 4

    code = main(sys.argv[1], sys.argv[2])
    if sys.argv[2] == "leave":
        exits.leave(code, bound=BOUND)
    sys.exit(code)
''')


@pytest.fixture
def run_script(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        assert p.returncode is not None


def _start(started: list[subprocess.Popen[str]], tmp_path: Path, source: str, *args: str) -> subprocess.Popen[str]:
    path = tmp_path / f"script{len(started)}.py"
    path.write_text(source)
    p = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    started.append(p)
    return p


def test_a_stream_collected_under_a_held_condition_hangs_a_plain_exit(
        etcd: EtcdServer, tmp_path: Path, run_script: list[subprocess.Popen[str]]) -> None:
    """The fault itself, without the guard: the process never ends by itself (the test ends it)."""
    p = _start(run_script, tmp_path, SCRIPT.replace("BOUND", "2.0"), etcd.endpoint, "plain")
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "returning"
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=2 * 2.0)  # twice the bound the guarded run below keeps
    p.kill()
    assert p.wait(timeout=10) == -signal.SIGKILL


def test_a_process_that_decided_to_exit_is_gone_within_the_bound_with_its_code(
        etcd: EtcdServer, tmp_path: Path, run_script: list[subprocess.Popen[str]]) -> None:
    p = _start(run_script, tmp_path, SCRIPT.replace("BOUND", "2.0"), etcd.endpoint, "leave")
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "returning"
    returned = time.monotonic()
    code = p.wait(timeout=2.0 + SLACK)
    took = time.monotonic() - returned
    _, err = p.communicate(timeout=5)
    assert code == 4, err
    assert took <= 2.0 + SLACK
    assert "had to leave without finishing its clean-up (it decided to exit with code 4)" in err
    assert "_channel.py" in err and "__del__" in err, "the stacks name the finaliser that blocked"


def test_leave_closes_every_stream_and_ends_at_once_when_nothing_blocks(
        etcd: EtcdServer, tmp_path: Path, run_script: list[subprocess.Popen[str]]) -> None:
    source = textwrap.dedent('''
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from stalwart import exits
        from stalwart.etcd.store import Store
        exits.set_context("job=j node=n")
        store = Store([sys.argv[1]])
        store.lease_grant(30)  # the keep-alive thread
        watch = store.watch("/exits/", prefix=True)  # a stream its owner forgets to cancel
        exits.leave(3)
    ''')
    p = _start(run_script, tmp_path, source, etcd.endpoint)
    start = time.monotonic()
    code = p.wait(timeout=exits.EXIT_BOUND + SLACK)
    _, err = p.communicate(timeout=5)
    assert code == 3, err
    assert "job=j node=n: leaving with exit code 3" in err
    assert "had to leave" not in err
    assert time.monotonic() - start < exits.EXIT_BOUND


def test_closing_a_store_cancels_the_watches_its_owners_left_open(etcd: EtcdServer) -> None:
    store = Store([etcd.endpoint], timeout=5.0)
    watch = store.watch("/exits-close/", prefix=True)
    pumps = [t for t in threading.enumerate() if t.name.startswith("etcd-watch:b'/exits-close/")]
    assert len(pumps) == 1
    store.close()
    pumps[0].join(timeout=5)
    assert not pumps[0].is_alive()
    with pytest.raises(StoreError, match="watch has ended"):
        watch.next(timeout=1)
    with pytest.raises(StoreError, match="store is closed"):
        store.watch("/exits-close/")


GUARDED = textwrap.dedent('''
    import atexit, sys, time
    from stalwart import exits
    atexit.register(time.sleep, 3600)  # a finaliser that blocks (it runs after the guard's hook)
    exits.guard_exit(bound=1.0, began=lambda: print("began", flush=True))
    print("returned", flush=True)
''')


def test_a_rank_whose_exit_blocks_says_when_its_exit_began_and_where_it_is_stuck(
        tmp_path: Path, run_script: list[subprocess.Popen[str]]) -> None:
    """The rank's side of the bound: it tells its supervisor that the exit began (the agent ends it from there:
    the test below) and leaves its stacks in its log; its exit code stays its own."""
    p = _start(run_script, tmp_path, GUARDED)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "returned"
    assert p.stdout.readline().strip() == "began"
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=1.0 + 2.0)  # past the bound: the stacks are out, the process is still there
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL
    _, err = p.communicate(timeout=5)
    assert "Timeout (0:00:00.500000)!" in err, "the stacks before the bound say where the exit was stuck"


def _status(path: Path, pid: int, state: str, exiting: float | None) -> None:
    record = RankStatus.model_validate({"slot": 0, "pid": pid, "state": state, "heartbeat": time.monotonic(),
                                        "exiting": exiting})
    path.write_bytes(record.model_dump_json().encode())


@pytest.mark.parametrize(("state", "began_ago", "expected"), [
    ("done", exits.EXIT_BOUND + 1, 0),  # returned, began to exit, stuck past the bound: ended, a success
    ("done", None, None),  # returned, its script still runs (saving a checkpoint, say): finish_grace applies
    ("done", 1.0, None),  # its exit began a moment ago: within the bound
    ("running", exits.EXIT_BOUND + 1, None),  # never returned: the hard timeout's business, not this bound
])
def test_the_agent_ends_a_rank_whose_exit_overran_after_the_training_function_returned(
        tmp_path: Path, state: str, began_ago: float | None, expected: int | None) -> None:
    status = tmp_path / "status.json"
    ranks = RankProcesses(status_interval=0.0, finish_grace=600.0, context="job=j node=n")
    p = ranks.start([sys.executable, "-c", "import time; time.sleep(600)"], os.environ, 0, slot=0,
                    status_file=status, fresh=True)
    try:
        _status(status, p.popen.pid, state, None if began_ago is None else time.monotonic() - began_ago)
        ranks.views()
        if expected is not None:
            p.popen.wait(timeout=30)
        ranks.poll()
        assert p.exit_code == expected
    finally:
        p.popen.kill()
        p.popen.wait(timeout=30)
