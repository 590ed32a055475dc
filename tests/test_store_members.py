"""Which etcd member a Store speaks to after a failure (stalwart/etcd/members.py), as tables."""

from __future__ import annotations

import pytest

from stalwart.etcd.errors import (
    LeaseNotFound,
    StoreError,
    StorePermissionDenied,
    StoreSecurityError,
    StoreTimeout,
    StoreUnavailable,
)
from stalwart.etcd.members import moves_on, next_member


@pytest.mark.parametrize(("current", "failed", "count", "expected"), [
    (0, 0, 3, 1),   # the member in use failed: the next one
    (2, 2, 3, 0),   # round the list
    (1, 0, 3, 1),   # another thread already moved past the failed member: stay
    (0, 0, 1, 0),   # one member: nowhere else to go
])
def test_next_member(current: int, failed: int, count: int, expected: int) -> None:
    assert next_member(current, failed, count) == expected


def test_next_member_needs_a_member() -> None:
    with pytest.raises(ValueError, match="count: expected at least one member, got 0"):
        next_member(0, 0, 0)


@pytest.mark.parametrize(("error", "expected"), [
    (StoreUnavailable("etcd unavailable during get"), True),
    (StoreTimeout("etcd get timed out"), True),
    (StoreSecurityError("wrong password"), False),       # every member would refuse it the same
    (StorePermissionDenied("no permission"), False),
    (LeaseNotFound("lease not found"), False),
    (StoreError("etcd txn failed: too many operations"), False),
])
def test_which_failures_move_to_another_member(error: StoreError, expected: bool) -> None:
    assert moves_on(error) is expected
