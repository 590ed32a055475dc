"""Rank assignment: pure, so tested exhaustively over small worlds with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.restart.assignment import Candidate, RankAssignment, WorldTooSmall, initial_ranks


def test_fill_keeps_survivors_and_gives_the_gap_to_a_spare() -> None:
    a = RankAssignment().assign([Candidate(0), Candidate(1), Candidate(3), Candidate(4, spare=True)],
                                initial_ranks(4), 4)
    assert a.ranks == {0: 0, 1: 1, 3: 3, 4: 2}
    assert a.inactive == []


def test_fill_without_spares_moves_the_top_rank_down() -> None:
    a = RankAssignment().assign([Candidate(1), Candidate(2), Candidate(3)], initial_ranks(4), 4)
    assert a.ranks == {1: 1, 2: 2, 3: 0}


def test_shift_keeps_order() -> None:
    a = RankAssignment(mode="shift").assign([Candidate(1), Candidate(3), Candidate(5, spare=True)],
                                            initial_ranks(4), 4)
    assert a.ranks == {1: 0, 3: 1, 5: 2}


def test_a_respawned_process_takes_its_rank_back() -> None:
    previous = {0: 0, 2: 1}  # slot 1 was missing last iteration and slot 2 (a spare) held rank 1
    a = RankAssignment().assign([Candidate(0), Candidate(1), Candidate(2, spare=True)], previous, 2)
    assert a.ranks == {0: 0, 2: 1}
    assert a.inactive == [1]


def test_divisible_by_cuts_the_world_and_keeps_the_rest_as_spares() -> None:
    a = RankAssignment(divisible_by=2).assign([Candidate(0), Candidate(1), Candidate(2)], initial_ranks(4), 4)
    assert a.world_size == 2
    assert a.inactive == [2]


def test_unhealthy_candidates_get_no_rank() -> None:
    a = RankAssignment().assign([Candidate(0), Candidate(1, healthy=False)], initial_ranks(2), 2)
    assert a.ranks == {0: 0}


def test_min_world_size() -> None:
    with pytest.raises(WorldTooSmall, match="min_world_size is 3"):
        RankAssignment(min_world_size=3).assign([Candidate(0), Candidate(1)], initial_ranks(4), 4)


@pytest.mark.parametrize(("asked", "job", "effective"), [
    (1, None, 1),  # no job minimum (a script run without an agent)
    (1, 2, 2),     # the job's minimum holds over the decorator's default
    (3, 2, 3),     # a decorator may ask for more than its job
    (2, 2, 2),
])
def test_the_jobs_minimum_raises_the_policys(asked: int, job: int | None, effective: int) -> None:
    policy = RankAssignment(mode="shift", min_world_size=asked, divisible_by=1)
    raised = policy.at_least(job)
    assert (raised.min_world_size, raised.mode) == (effective, "shift")
    if effective == asked:
        assert raised is policy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "random"}, "RankAssignment.mode"),
    ({"min_world_size": 0}, "RankAssignment.min_world_size"),
    ({"divisible_by": 0}, "RankAssignment.divisible_by"),
])
def test_invalid_policy_is_refused_on_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankAssignment(**kwargs)


@settings(deadline=None)
@given(target=st.integers(1, 8), spares=st.integers(0, 3), present=st.data(),
       mode=st.sampled_from(["fill", "shift"]), divisible_by=st.integers(1, 3))
def test_assignment_invariants(target: int, spares: int, present: st.DataObject, mode: str,
                               divisible_by: int) -> None:
    slots = list(range(target + spares))
    chosen = present.draw(st.lists(st.sampled_from(slots), unique=True, min_size=1))
    candidates = [Candidate(s, spare=s >= target) for s in chosen]
    policy = RankAssignment(mode=mode, divisible_by=divisible_by)  # type: ignore[arg-type]
    try:
        a = policy.assign(candidates, initial_ranks(target), target)
    except WorldTooSmall:
        assert min(len(chosen), target) < divisible_by
        return
    # Ranks are exactly 0..world-1, each held by one present process; the world is as large as allowed.
    assert sorted(a.ranks.values()) == list(range(a.world_size))
    assert set(a.ranks) <= set(chosen)
    assert a.world_size % divisible_by == 0
    expected = min(len(chosen), target)
    assert a.world_size == expected - expected % divisible_by
    assert set(a.inactive) == set(chosen) - set(a.ranks)
    if mode == "fill":
        # A survivor keeps its rank whenever that rank is still inside the world.
        for s in chosen:
            if s < target and s < a.world_size and s in a.ranks:
                assert a.ranks[s] == s
    # Equal inputs, equal outputs (every process computes the same seal).
    assert policy.assign(list(reversed(candidates)), initial_ranks(target), target) == a
