"""The pure parts of the RPC layer: retry options and backoff, the timer heap, completion records."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stalwart.rpc.dedup import CompletionTable, Verdict
from stalwart.rpc.retry import RetryOptions, backoff_delay
from stalwart.rpc.timers import TimerHeap


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_retries": -1}, "max_retries"),
    ({"initial_delay": 0}, "initial_delay"),
    ({"multiplier": 0.5}, "multiplier"),
    ({"max_delay": -1.0}, "max_delay"),
    ({"jitter": 1.5}, "jitter"),
    ({"deadline": 0}, "deadline"),
    ({"attempt_timeout": 0}, "attempt_timeout"),
    ({"bogus": 1}, "bogus"),
])
def test_retry_options_errors_name_the_argument(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        RetryOptions(**kwargs)  # type: ignore[arg-type]
    assert field in str(e.value)


def test_retry_options_cross_field_rules_name_both_arguments() -> None:
    with pytest.raises(ValidationError, match=r"max_delay .* initial_delay"):
        RetryOptions(initial_delay=2.0, max_delay=1.0)
    with pytest.raises(ValidationError, match=r"attempt_timeout .* deadline"):
        RetryOptions(attempt_timeout=10.0, deadline=5.0)


@given(initial=st.floats(0.001, 5), mult=st.floats(1, 10), cap=st.floats(0.001, 60), jitter=st.floats(0, 1),
       retry=st.integers(1, 5000), seed=st.integers(0, 2**32))
def test_backoff_is_bounded_and_grows(initial: float, mult: float, cap: float, jitter: float, *, retry: int,
                                      seed: int) -> None:
    cap = max(cap, initial)
    opts = RetryOptions(initial_delay=initial, multiplier=mult, max_delay=cap, jitter=jitter)
    d = backoff_delay(opts, retry, random.Random(seed))
    assert 0 <= d <= cap
    plain = opts.model_copy(update={"jitter": 0.0})
    assert backoff_delay(plain, retry, random.Random(seed)) <= backoff_delay(plain, retry + 1, random.Random(seed))
    with pytest.raises(ValueError, match="retry"):
        backoff_delay(opts, 0, random.Random(seed))


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["add", "cancel", "pop"]), st.floats(0, 100)), max_size=300))
def test_timer_heap_matches_a_sorted_model(ops: list[tuple[str, float]]) -> None:
    heap = TimerHeap()
    model: dict[int, float] = {}
    timers = {}
    fired: list[int] = []
    n = 0
    for op, x in ops:
        if op == "add":
            n += 1
            i = n
            timers[i] = heap.schedule(x, lambda i=i: fired.append(i))  # type: ignore[misc]
            model[i] = x
        elif op == "cancel" and model:
            i = sorted(model)[int(x) % len(model)]
            assert heap.cancel(timers[i])
            assert not heap.cancel(timers[i])
            del model[i]
        elif op == "pop":
            for action in heap.pop_due(x):
                action()
            expect = sorted((due, i) for i, due in model.items() if due <= x)
            assert fired == [i for _, i in expect]
            for i in fired:
                del model[i]
            fired.clear()
        assert len(heap) == len(model)
        assert heap.next_due() == (min(model.values()) if model else None)


def test_timer_heap_compacts_cancelled_entries() -> None:
    heap = TimerHeap()
    timers = [heap.schedule(float(i), lambda: None) for i in range(10_000)]
    for t in timers[:9_990]:
        heap.cancel(t)
    assert len(heap) == 10
    assert len(heap._heap) <= 2 * 10 + 64  # dead entries do not pile up
    assert len(heap.pop_due(1e9)) == 10


def test_completion_records_replay_and_collect() -> None:
    table: CompletionTable[bytes] = CompletionTable()
    a = ("w1", "inc1")
    assert table.admit(a, 1, ack=1) == (Verdict.NEW, None)
    assert table.admit(a, 1, ack=1) == (Verdict.RUNNING, None)  # duplicate while running
    table.complete(a, 1, b"reply-1")
    assert table.admit(a, 1, ack=1) == (Verdict.DONE, b"reply-1")  # duplicate after: replayed
    assert table.admit(a, 2, ack=1) == (Verdict.NEW, None)
    table.complete(a, 2, b"reply-2")
    # the sender says everything below 3 is finished: records 1 and 2 go
    assert table.admit(a, 3, ack=3) == (Verdict.NEW, None)
    assert len(table) == 1
    assert table.admit(a, 1, ack=3) == (Verdict.EXPIRED, None)  # never run again
    # a reply for a request the sender has given up on is not stored
    table.complete(a, 0, b"late")
    assert len(table) == 1
    # another incarnation of the same name is a different sender
    assert table.admit(("w1", "inc2"), 1, ack=1) == (Verdict.NEW, None)
    assert table.forget_worker("w1") == 2
    assert len(table) == 0


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=200))
def test_completion_records_never_run_a_request_twice(arrivals: list[tuple[int, bool]]) -> None:
    """Whatever the order and duplication of arrivals, each request id runs at most once."""
    table: CompletionTable[int] = CompletionTable()
    sender = ("w", "i")
    ran: list[int] = []
    finished: set[int] = set()
    for rid, complete in arrivals:
        outstanding = [r for r in range(31) if r not in finished]
        ack = min(outstanding) if outstanding else 31
        verdict, _ = table.admit(sender, rid, ack)
        if verdict == Verdict.NEW:
            ran.append(rid)
        if complete:
            table.complete(sender, rid, rid)
            finished.add(rid)
    assert len(ran) == len(set(ran))
