"""A node blocked in the rendezvous stops when asked, and a node whose key keeps being revoked (fenced) backs
off between registrations instead of hammering etcd. Real etcd."""

from __future__ import annotations

import threading
import time

import pytest
from rdzv_helpers import record

from stalwart.agent.rendezvous import RendezvousCancelled, RendezvousSettings
from stalwart.agent.rendezvous.node import KEY_LOSS_BACKOFF
from stalwart.etcd.keys import NODES, JobKeys
from stalwart.etcd.store import Store

pytestmark = pytest.mark.integration


def _join_in_thread(h: object) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def go() -> None:
        try:
            h.join()  # type: ignore[attr-defined]
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, errors


def test_cancel_ends_a_join_blocked_below_min_nodes_at_once(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=30))
    h = r.node(record("alone"))
    t, errors = _join_in_thread(h)
    deadline = time.monotonic() + 30
    while store.get(job_keys.rendezvous + NODES + "alone") is None:  # registered, now waiting for a peer
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    asked = time.monotonic()
    h.cancel()
    t.join(timeout=10)
    assert not t.is_alive(), "join ignored the stop request"
    assert len(errors) == 1 and isinstance(errors[0], RendezvousCancelled)
    # Bounded by one wake-up of the handle (1 s), not by the join timeout (600 s).
    assert time.monotonic() - asked < 5
    with pytest.raises(RendezvousCancelled):
        h.join()


def test_a_node_whose_key_keeps_being_revoked_backs_off(make_rdzv, store: Store, job_keys: JobKeys) -> None:
    # The operator fences a zombie by revoking the lease of its node key whenever it sees one. Without a back-off
    # the zombie registered again at once, about 17 times a second, until it was killed.
    r = make_rdzv(RendezvousSettings(min_nodes=2, max_nodes=2, node_ttl=30))
    h = r.node(record("zombie"))
    t, errors = _join_in_thread(h)
    key = job_keys.rendezvous + NODES + "zombie"
    leases: set[int] = set()
    window = 4.0
    end = time.monotonic() + window
    while time.monotonic() < end:
        kv = store.get(key)
        if kv is not None and kv.lease:
            leases.add(kv.lease)
            store.lease_revoke(kv.lease)
        time.sleep(0.02)
    h.cancel()
    t.join(timeout=10)
    assert not t.is_alive() and isinstance(errors[0], RendezvousCancelled)
    # The waits after each loss are at least (1 - jitter) x 0.5, 1, 2, 4 s: at most 4 losses fit in the window,
    # hence at most 5 registrations (fewer when the revoker misses one between its polls).
    least = [KEY_LOSS_BACKOFF.delay(n, 0.0) for n in range(1, 6)]
    fit = sum(1 for i in range(len(least)) if sum(least[: i + 1]) <= window)
    assert 2 <= len(leases) <= fit + 1, (len(leases), least)
