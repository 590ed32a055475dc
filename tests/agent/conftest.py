"""Fixtures shared by the agent's tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store


@pytest.fixture
def job(store: Store) -> Iterator[tuple[JobKeys, int]]:
    """A fresh job's keys and the epoch of a round (a manifest written); its keys are deleted afterwards."""
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    epoch = store.put(keys.rendezvous + "manifest", b"{}")
    yield keys, epoch
    store.delete_prefix(keys.prefix)
