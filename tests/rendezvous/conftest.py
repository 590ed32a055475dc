"""Fixtures of the rendezvous tests: a fresh job prefix on the real etcd, and Rendezvous objects."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

import pytest

from stalwart.agent.rendezvous import Rendezvous, RendezvousSettings
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store


@pytest.fixture
def job_keys(store: Store) -> Iterator[JobKeys]:
    keys = JobKeys("test", uuid.uuid4().hex[:16])
    yield keys
    with contextlib.suppress(Exception):  # the test may have left etcd stopped
        store.delete_prefix(keys.prefix)


RdzvFactory = Callable[..., Rendezvous]


@pytest.fixture
def make_rdzv(store: Store, job_keys: JobKeys) -> Iterator[RdzvFactory]:
    """Build Rendezvous objects on the shared store (or a given one); all are shut down afterwards."""
    made: list[Rendezvous] = []

    def make(settings: RendezvousSettings, on: Store | None = None) -> Rendezvous:
        r = Rendezvous(on or store, job_keys, settings)
        made.append(r)
        return r

    yield make
    for r in made:
        r.shutdown()
