"""A watch that goes silent (etcd stops delivering to it, the connection lives on) is noticed, and an idle one
that etcd still serves is not mistaken for it. Real etcd; the silence is injected on the response stream."""

from __future__ import annotations

import time
from typing import Any

import pytest

from stalwart.etcd import watch as watch_module
from stalwart.etcd.store import Store, StoreTimeout
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration


class Muted:
    """A watch's response stream whose responses are all dropped from ``after`` on (a stuck watcher)."""

    def __init__(self, inner: Any, after: float) -> None:
        self.inner, self.after = inner, after

    def __iter__(self) -> Muted:
        return self

    def __next__(self) -> Any:
        while True:
            resp = next(self.inner)
            if time.monotonic() < self.after:
                return resp

    def cancel(self) -> None:
        self.inner.cancel()


def test_an_idle_watch_that_etcd_still_serves_is_not_silent(etcd: EtcdServer, prefix: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_module, "WATCH_IDLE_CHECK", 0.5)
    with Store([etcd.endpoint], timeout=2.0) as s, s.watch(prefix, prefix=True) as w:
        end = time.monotonic() + 6  # several idle checks, each answered
        while time.monotonic() < end:
            assert w.next(0.2) is None
        s.put(prefix + "k", b"v")
        ev = w.next(5.0)
        assert ev is not None and ev.kv.key == prefix + "k"


def test_a_silent_watch_raises_within_the_idle_check_and_the_timeout(etcd: EtcdServer, prefix: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_module, "WATCH_IDLE_CHECK", 1.0)
    with Store([etcd.endpoint], timeout=2.0) as s:
        stub = s._members.current().watch
        inner = stub.Watch
        muted_from = time.monotonic() + 0.5  # after the watch is created
        monkeypatch.setattr(stub, "Watch", lambda *a, **kw: Muted(inner(*a, **kw), muted_from))
        with s.watch(prefix, prefix=True) as w:
            time.sleep(0.6)
            s.put(prefix + "lost", b"v")  # never delivered
            start = time.monotonic()
            with pytest.raises(StoreTimeout, match="watch silent"):
                while time.monotonic() - start < 30:
                    assert w.next(0.2) is None
            # Noticed after the idle check and the timeout (3 s here), not left waiting for what never comes.
            assert time.monotonic() - start < 15
