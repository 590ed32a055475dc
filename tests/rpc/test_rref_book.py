"""The RRef protocol's bookkeeping, without any server: G1, G2, parked deletes, fate-sharing."""

from __future__ import annotations

from stalwart.rref.book import Control, PendingChild, RRefBook


def test_remote_creation_then_user_delete_frees_the_value() -> None:
    owner = RRefBook("o")
    owner.create("c:1:1", "c:1:2", "c")
    assert owner.owners["c:1:1"].forks == {"c:1:2": "c"}
    assert owner.delete_request("c:1:1", "c:1:2", "c") == ["c:1:1"]
    assert owner.is_quiescent() and owner.generation == 1


def test_delete_before_create_is_parked_not_lost() -> None:
    owner = RRefBook("o")
    assert owner.delete_request("c:1:1", "c:1:2", "c") == []
    assert owner.parked == {"c:1:1": {"c:1:2": "c"}}
    # the creation arrives late: its only reference is already gone, so the value is freed at once
    assert owner.create("c:1:1", "c:1:2", "c") == ["c:1:1"]
    assert owner.is_quiescent()


def test_delete_before_fork_request_is_parked() -> None:
    owner = RRefBook("o")
    owner.create("c:1:1", "c:1:2", "c")
    owner.delete_request("c:1:1", "b-fork", "b")  # B's delete overtakes B's fork request
    owner.fork_request("c:1:1", "b-fork", "b")
    assert owner.owners["c:1:1"].forks == {"c:1:2": "c"}
    assert owner.parked == {}


def test_g2_parent_keeps_its_reference_until_the_child_is_accepted() -> None:
    a, b = RRefBook("a"), RRefBook("b")
    a.new_user("a-fork", "r", "o", "o", confirmed=True)
    handle = object()
    parent = a.fork_for("b", "r", "o", "b-fork", handle, own_fork="a-fork")
    assert parent == "a" and a.children["b-fork"].keep is handle
    rec, controls = b.received("r", "b-fork", "o", "a")
    assert rec is not None and not rec.confirmed
    assert controls == [Control("o", "fork", "r", "b-fork")]
    # the user releases A's handle now: the delete waits until the child is confirmed
    assert a.released("a-fork") == []
    assert "b-fork" in a.children and "a-fork" in a.deferred
    follow = b.fork_confirmed("b-fork", "r", "a")
    assert follow == [Control("a", "accept", "r", "b-fork")]
    assert a.child_accepted("b-fork") == ([Control("o", "delete", "r", "a-fork")], [])
    assert a.is_quiescent()


def test_owner_forks_directly_and_the_child_needs_no_handshake() -> None:
    o, b = RRefBook("o"), RRefBook("b")
    o.create("r", None, "o")
    o.handle_added("r")
    assert o.fork_for("b", "r", "o", "f1", object()) == "o"
    assert o.owners["r"].forks == {"f1": "b"}
    rec, controls = b.received("r", "f1", "o", "o")
    assert rec is not None and rec.confirmed and controls == []


def test_a_fork_to_ourselves_keeps_the_owned_value() -> None:
    o = RRefBook("o")
    o.handle_added("r")
    o.create("r", None, "o")
    o.fork_for("o", "r", "o", "f-self", object())
    assert o.handle_dropped("r") == []  # the pending child to ourselves still holds it
    o.received("r", "f-self", "o", "o")
    assert o.handle_dropped("r") == ["r"]


def test_a_deferred_delete_goes_out_when_a_child_sent_to_ourselves_arrives() -> None:
    a = RRefBook("a")
    a.new_user("a-fork", "r", "o", "o", confirmed=True)
    a.fork_for("a", "r", "o", "a-fork-2", object(), own_fork="a-fork")
    assert a.released("a-fork") == []  # deferred: a child is in flight
    _, controls = a.received("r", "a-fork-2", "o", "a")
    assert controls == [Control("o", "fork", "r", "a-fork-2")]
    assert a.fork_confirmed("a-fork-2", "r", "a") == [Control("o", "delete", "r", "a-fork")]


def test_worker_death_fate_sharing() -> None:
    o = RRefBook("o")
    o.create("r1", "f-dead", "dead")
    o.fork_request("r1", "f-live", "live")
    o.create("r2", "f2", "dead")
    o.delete_request("r3", "fx", "dead")  # parked from the dead worker
    o.new_user("u1", "r9", "dead", "dead", confirmed=True)
    o.children["c1"] = PendingChild("c1", "r9", "dead", object())  # a fork we sent to the dead worker
    freed = o.worker_died("dead")
    assert freed == ["r2"]
    assert o.owners["r1"].forks == {"f-live": "live"}
    assert o.parked == {}
    assert o.children == {}
    assert o.users["u1"].owner_dead
    assert o.released("u1") == []  # nothing to tell a dead owner
    # a fork request from a dead worker that arrives late is ignored
    o.fork_request("r1", "f-late", "dead")
    assert "f-late" not in o.owners["r1"].forks


def test_creation_never_arrives_when_the_creator_dies() -> None:
    o = RRefBook("o")
    o.fork_request("c:1:1", "f-b", "b")  # a fork request overtook the creation
    assert not o.owners["c:1:1"].created
    o.worker_died("c")
    rec = o.owners["c:1:1"]
    assert rec.state == "failed" and rec.error is not None and "creator" in rec.error[1]
    assert o.delete_request("c:1:1", "f-b", "b") == ["c:1:1"]
