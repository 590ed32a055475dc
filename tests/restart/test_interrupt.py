"""Interrupting the main thread from another thread: into sleeps, deferred by atomic(), cancelled on leave."""

from __future__ import annotations

import threading
import time

import pytest

from stalwart.restart.interrupt import Interrupter, RestartInterrupt


def _request_soon(interrupter: Interrupter, started: threading.Event) -> threading.Thread:
    def go() -> None:
        started.wait(30)
        interrupter.request("test")
        # As the monitor does: signal again until the interrupt has ended the sleep.
        while interrupter.requested is not None and interrupter.in_user_code:
            interrupter.nudge()
            time.sleep(0.05)

    t = threading.Thread(target=go)
    t.start()
    return t


def test_interrupt_breaks_a_sleep_in_the_main_thread() -> None:
    it = Interrupter()
    started = threading.Event()
    t = _request_soon(it, started)
    it.enter_user_code()
    try:
        with pytest.raises(RestartInterrupt):
            started.set()
            time.sleep(120)  # pytest's timeout would fail the test long before this returns
    finally:
        it.leave_user_code()
        t.join()
        it.close()
    assert it.requested == "test"


def test_interrupt_waits_for_the_end_of_an_atomic_section() -> None:
    it = Interrupter()
    it.enter_user_code()
    finished_section = False
    try:
        with pytest.raises(RestartInterrupt), it.atomic():
            assert it.request("from another part") is False  # deferred: not delivered inside
            time.sleep(0.05)
            finished_section = True
    finally:
        it.leave_user_code()
        it.close()
    assert finished_section


def test_no_interrupt_outside_user_code() -> None:
    it = Interrupter()
    assert it.request("before") is False  # not in user code: nothing delivered
    assert it.requested == "before"
    it.enter_user_code()  # a new iteration starts clean
    assert it.requested is None
    it.leave_user_code()
    assert it.request("after") is False
    for _ in range(1000):
        pass  # bytecodes run here; a stray interrupt would be raised now
    it.close()


def test_a_request_for_an_earlier_run_requests_nothing() -> None:
    it = Interrupter()
    it.enter_user_code()
    first = it.generation
    it.leave_user_code()
    it.enter_user_code()  # the next iteration's run
    try:
        assert it.request("a hang of the run before", generation=first) is None
        assert it.requested is None
        for _ in range(1000):
            pass  # a stray interrupt would be raised here
        with pytest.raises(RestartInterrupt):
            assert it.request("this run's own fault", generation=it.generation) is True
            for _ in range(1000):
                pass
    finally:
        it.leave_user_code()
        it.close()


def test_only_one_interrupt_per_iteration() -> None:
    it = Interrupter()
    it.enter_user_code()
    try:
        with pytest.raises(RestartInterrupt):
            assert it.request("one") is True
            for _ in range(1000):
                pass
    finally:
        assert it.request("two") is False
        it.leave_user_code()
        it.close()


def test_interrupt_waits_until_an_import_has_finished(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    (tmp_path / "slow_module_for_interrupt.py").write_text(
        "import time\nSTARTED = time.monotonic()\ntime.sleep(0.5)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    it = Interrupter()
    started = threading.Event()
    t = _request_soon(it, started)
    it.enter_user_code()
    try:
        with pytest.raises(RestartInterrupt):
            started.set()
            import slow_module_for_interrupt  # noqa: F401
            time.sleep(120)
    finally:
        it.leave_user_code()
        t.join()
        it.close()
    module = sys.modules["slow_module_for_interrupt"]
    assert module.DONE is True  # the import ran to its end; the interrupt came after it


def test_interrupt_waits_while_the_thread_is_inside_code_that_takes_locks() -> None:
    # An exception raised inside logging (or gRPC) code can leave its lock held for good: the interrupt waits
    # until the thread has left it, and comes at the next nudge after.
    import logging

    inside, release = threading.Event(), threading.Event()

    class SlowHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            inside.set()
            release.wait(30)

    logger = logging.getLogger("test.interrupt.locking")
    logger.propagate = False
    handler = SlowHandler()
    logger.addHandler(handler)
    outcome: list[str] = []
    holder: list[Interrupter] = []

    def user_code() -> None:
        it = Interrupter()
        holder.append(it)
        it.enter_user_code()
        try:
            try:
                logger.warning("held")  # blocks in the handler until released
                outcome.append("logged")
                for _ in range(3000):  # not the main thread: no signal breaks a sleep, bytecodes between them do
                    time.sleep(0.01)
            finally:
                it.leave_user_code()
        except RestartInterrupt:
            outcome.append("interrupted")

    t = threading.Thread(target=user_code)
    t.start()
    try:
        assert inside.wait(30)
        [it] = holder
        assert it.request("a peer failed") is False  # not delivered inside logging
        assert it.pending()
        release.set()
        while t.is_alive() and it.pending():
            it.nudge()
            time.sleep(0.01)
        t.join(30)
    finally:
        release.set()
        logger.removeHandler(handler)
        t.join(30)
    assert not t.is_alive()
    assert outcome == ["logged", "interrupted"]
    assert handler.lock is not None and handler.lock.acquire(timeout=1)  # the handler's lock was not left held
    handler.lock.release()
