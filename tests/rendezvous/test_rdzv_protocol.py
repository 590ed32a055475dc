"""The rendezvous protocol as a pure state machine: no etcd, no clock, no threads."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stalwart.agent.rendezvous.protocol import (
    Claim,
    ClaimFailed,
    EndRound,
    KeyDeleted,
    KeyPut,
    LocalNode,
    NodeEntry,
    Observed,
    Reloaded,
    Seal,
    SealerClaim,
    SealFailed,
    State,
    Tick,
    View,
    WakeAt,
    apply,
    plan_round,
    role_of,
    round_status,
    step,
    waiting_nodes,
)
from stalwart.agent.rendezvous.reading import light_view
from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.api.manifest import ManifestHeader, encode_manifest, manifest_part_key
from stalwart.api.rendezvous import (
    ExpectedNodes,
    Manifest,
    NodeRecord,
    RerendezvousRequest,
    SealerRecord,
)
from stalwart.etcd.store import KeyValue, TxnResult


class Etcd:
    """A tiny revision counter that turns writes into the events the watch would deliver."""

    def __init__(self) -> None:
        self.revision = 1
        self.created: dict[str, int] = {}

    def put(self, key: str, value: bytes, lease: int = 0) -> KeyPut:
        self.revision += 1
        create = self.created.setdefault(key, self.revision)
        return KeyPut(key, value, create, self.revision, lease)

    def delete(self, key: str) -> KeyDeleted:
        self.revision += 1
        self.created.pop(key, None)
        return KeyDeleted(key, self.revision)

    def node(self, node_id: str, *, spare: bool = False, nproc: int = 1) -> KeyPut:
        rec = NodeRecord(node_id=node_id, address=f"10.0.0.{len(self.created) + 1}", spare=spare, nproc=nproc)
        return self.put("nodes/" + node_id, rec.to_json_bytes(), lease=1)

    def seal(self, seal: Seal) -> KeyPut:
        return self.put("manifest", seal.manifest.to_json_bytes())

    def sealer(self, node_id: str) -> KeyPut:
        return self.put("sealer", SealerRecord(node_id=node_id).to_json_bytes(), lease=1)


def run(state: State, event: object, s: RendezvousSettings) -> tuple[State, list[object]]:
    new, actions = step(state, event, s)  # type: ignore[arg-type]
    return new, list(actions)


def seals(actions: list[object]) -> list[Seal]:
    return [a for a in actions if isinstance(a, Seal)]


def test_settings_are_validated_with_clear_messages() -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        RendezvousSettings(min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError, match="min_nodes"):
        RendezvousSettings(min_nodes=0, max_nodes=2)
    with pytest.raises(ValueError, match="node_ttl"):
        RendezvousSettings(min_nodes=1, max_nodes=2, node_ttl=1)
    with pytest.raises(ValueError, match="last_call_timeout"):
        RendezvousSettings(min_nodes=1, max_nodes=2, last_call_timeout=float("nan"))


def test_round_seals_at_max_by_the_sealer_only() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=5)
    etcd = Etcd()
    a, b = State(local=frozenset({"a"})), State(local=frozenset({"b"}))
    evs = (etcd.node("a"), etcd.node("b"), etcd.node("c"), etcd.sealer("a"))
    a, acts_a = run(a, Observed(evs, 0.0), s)
    b, acts_b = run(b, Observed(evs, 0.0), s)
    assert acts_b == []  # b does not hold the sealer's key: it never writes
    [seal] = seals(acts_a)
    assert seal.sealer == "a" and seal.over_epoch == 0
    assert [m.node_id for m in seal.manifest.members] == ["a", "b", "c"]
    assert seal.manifest.world_size == 3 and seal.manifest.round == 1
    # The same view never gives a second attempt; a refused seal is retried.
    a2, again = run(a, Tick(1.0), s)
    assert seals(again) == []
    _, retry = run(a2, SealFailed(1.5), s)
    assert len(seals(retry)) == 1


def test_between_min_and_max_the_last_call_runs_out_before_sealing() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=4, last_call_timeout=5)
    etcd = Etcd()
    st0 = State(local=frozenset({"a"}))
    st1, acts = run(st0, Observed((etcd.node("a"), etcd.sealer("a")), 0.0), s)
    assert acts == []  # below min: nothing to do, no timer
    st2, acts = run(st1, Observed((etcd.node("b"),), 1.0), s)
    assert acts == [WakeAt(6.0)]
    st3, acts = run(st2, Observed((etcd.node("c"),), 3.0), s)
    assert acts == [WakeAt(6.0)]  # the deadline does not move with each arrival
    _, acts = run(st3, Tick(6.0), s)
    [seal] = seals(acts)
    assert len(seal.manifest.members) == 3


def test_expected_set_present_seals_without_the_last_call() -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=8, last_call_timeout=100)
    etcd = Etcd()
    exp = etcd.put("expected", ExpectedNodes(node_ids=["a", "b"]).to_json_bytes())
    st0, acts = run(State(local=frozenset({"a"})), Observed((exp, etcd.node("a"), etcd.sealer("a")), 0.0), s)
    assert acts == [WakeAt(100.0)]
    _, acts = run(st0, Observed((etcd.node("b"),), 1.0), s)
    assert len(seals(acts)) == 1


def test_nodes_beyond_max_are_spares_and_hot_spares_go_last() -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=2)
    etcd = Etcd()
    view = apply(View(), [etcd.node("h", spare=True), etcd.node("a"), etcd.node("b"), etcd.node("c")])
    m = plan_round(view, s, "h", "first round")
    assert [x.node_id for x in m.members] == ["a", "b"]
    assert m.spares == ["c", "h"]


def test_late_arrival_waits_and_a_lost_member_ends_the_round() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=2)
    etcd = Etcd()
    st0, acts = run(State(local=frozenset({"a"})),
                    Observed((etcd.node("a"), etcd.node("b"), etcd.sealer("a")), 0.0), s)
    [seal] = seals(acts)
    st1, acts = run(st0, Observed((etcd.seal(seal), etcd.node("late")), 0.1), s)
    assert acts == [] and round_status(st1.view).live
    assert role_of(st1.view, "late") == "waiting" and waiting_nodes(st1.view) == ["late"]
    assert role_of(st1.view, "b") == "member"
    # b's lease expires: the round ends, and the late node takes over b's group rank.
    st2, acts = run(st1, Observed((etcd.delete("nodes/b"),), 0.2), s)
    status = round_status(st2.view)
    assert not status.live and status.lost == ("b",)
    [seal2] = seals(acts)
    assert seal2.over_epoch == st1.view.epoch
    assert [(x.node_id, x.group_rank) for x in seal2.manifest.members] == [("a", 0), ("late", 1)]
    assert seal2.manifest.round == 2 and "lost: b" in seal2.manifest.reason
    # The manifest names the lost member as data too (the operator's status names it), and the header keeps it.
    assert seal2.manifest.lost == ["b"] and seal.manifest.lost == []
    assert ManifestHeader.of(seal2.manifest).lost == ["b"]


def test_a_rejoined_node_is_a_new_incarnation_and_ends_the_round() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=2)
    etcd = Etcd()
    st0, acts = run(State(local=frozenset({"a"})),
                    Observed((etcd.node("a"), etcd.node("b"), etcd.sealer("a")), 0.0), s)
    st1, _ = run(st0, Observed((etcd.seal(seals(acts)[0]),), 0.0), s)
    st2, acts = run(st1, Observed((etcd.delete("nodes/b"), etcd.node("b")), 0.0), s)
    assert not round_status(st2.view).live
    assert len(seals(acts)) == 1


def test_request_for_the_current_epoch_ends_the_round_and_old_requests_are_void() -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=1)
    etcd = Etcd()
    st0, acts = run(State(local=frozenset({"a"})), Observed((etcd.node("a"), etcd.sealer("a")), 0.0), s)
    st1, _ = run(st0, Observed((etcd.seal(seals(acts)[0]),), 0.0), s)
    epoch = st1.view.epoch
    old = RerendezvousRequest(epoch=epoch - 1, node_id="a", reason="old").to_json_bytes()
    st2, acts = run(st1, Observed((etcd.put("request", old),), 0.0), s)
    assert round_status(st2.view).live and acts == []
    req = RerendezvousRequest(epoch=epoch, node_id="a", reason="nan loss").to_json_bytes()
    st3, acts = run(st2, Observed((etcd.put("request", req),), 0.0), s)
    assert "requested by a: nan loss" in round_status(st3.view).reason
    assert len(seals(acts)) == 1


def test_closed_stops_new_rounds() -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=1)
    etcd = Etcd()
    _, acts = run(State(local=frozenset({"a"})),
                  Observed((etcd.put("closed", b"{}"), etcd.node("a")), 0.0), s)
    assert acts == []


def test_a_present_local_node_claims_the_sealers_key_once_per_view_when_nobody_holds_it() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=3)
    etcd = Etcd()
    b_put, c_put = etcd.node("b"), etcd.node("c")
    entry = NodeEntry(NodeRecord.from_json_bytes(b_put.value), b_put.create_revision, 7)
    # The process runs b and c. b's registration is known before the watch shows any node key: b claims.
    st0, acts = run(State(local=frozenset({"b", "c"}), view=View(full=False)), LocalNode("b", True, 0.0, entry), s)
    assert acts == [Claim("b", b_put.create_revision, 7)]
    # A newer view, nobody holds the key yet: the oldest local node claims again.
    st1, acts = run(st0, Observed((c_put,), 0.5), s)
    assert acts == [Claim("b", b_put.create_revision, 7)]
    st2, acts = run(st1, Tick(1.0), s)
    assert acts == []  # one claim per view
    st3, acts = run(st2, ClaimFailed(1.5), s)
    assert acts == [Claim("b", b_put.create_revision, 7)]  # etcd was unreachable: the next event retries
    _, acts = run(st3, Observed((etcd.sealer("x"),), 2.0), s)
    assert acts == []  # another node holds it
    closed = etcd.put("closed", b"{}")
    _, acts = run(State(local=frozenset({"b"})), Observed((b_put, closed), 0.0), s)
    assert acts == []  # a closed rendezvous needs no sealer


def test_the_sealer_must_hold_a_full_view_and_others_take_over_when_its_lease_goes() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=3)
    etcd = Etcd()
    st0, acts = run(State(local=frozenset({"b"})), Observed((etcd.node("a"), etcd.node("b"),
                                                              etcd.node("c"), etcd.sealer("a")), 0.0), s)
    assert acts == []
    # a's lease goes: its node key and the sealer's key with it. b claims the key.
    st1, acts = run(st0, Observed((etcd.delete("nodes/a"), etcd.delete("sealer")), 0.0), s)
    assert [type(a) for a in acts] == [Claim] and acts[0].node_id == "b"  # type: ignore[attr-defined]
    st2, acts = run(st1, Observed((etcd.sealer("b"),), 0.0), s)
    assert acts == [WakeAt(s.last_call_timeout)]
    # The same state over a light view waits for the driver to read the prefix in full.
    _, acts = run(replace(st1, view=replace(st1.view, full=False, memo={})), Observed((etcd.sealer("b"),), 0.0),
                  s)
    assert acts == []
    _, acts = run(st2, LocalNode("b", False, 1.0), s)
    assert acts == []


def test_corrupt_records_are_reported_and_ignored() -> None:
    etcd = Etcd()
    view = apply(View(), [etcd.put("nodes/x", b"\x80\x04not json"), etcd.node("a"),
                          etcd.put("nodes/y", NodeRecord(node_id="z", address="h").to_json_bytes()),
                          etcd.put("manifest", b'{"round": 0}')])
    assert set(view.nodes) == {"a"}
    assert "not a valid NodeRecord" in view.problems["nodes/x"]
    assert "does not match the key" in view.problems["nodes/y"]
    assert "Manifest" in view.problems["manifest"] and view.sealed is None


def test_manifest_model_rejects_inconsistent_ranks() -> None:
    with pytest.raises(ValueError, match="group ranks"):
        Manifest.model_validate({"round": 1, "worldSize": 1, "masterAddr": "h", "sealedBy": "a",
                                 "members": [{"nodeId": "a", "address": "h", "groupRank": 1,
                                              "rankOffset": 0, "nproc": 1}]})
    with pytest.raises(ValueError, match="node id"):
        NodeRecord(node_id="a/b", address="h")


@settings(max_examples=60, deadline=None)
@given(
    joins=st.lists(st.tuples(st.booleans(), st.integers(1, 4)), min_size=1, max_size=24),
    max_nodes=st.integers(1, 16),
    deaths=st.lists(st.integers(0, 23), max_size=6),
    newcomers=st.integers(0, 5),
)
def test_every_round_has_unique_contiguous_ranks_and_survivors_keep_theirs(
        joins: list[tuple[bool, int]], max_nodes: int, deaths: list[int], newcomers: int) -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=max_nodes)
    etcd = Etcd()
    view = apply(View(), [etcd.node(f"n{i}", spare=sp, nproc=p) for i, (sp, p) in enumerate(joins)])
    m1 = plan_round(view, s, "n0", "first")
    view = apply(view, [etcd.seal(Seal(m1, 0, "", 0, 0))])
    check_manifest(m1, len(joins), max_nodes)
    gone = {f"n{d}" for d in deaths if d < len(joins)}
    events = [etcd.delete(f"nodes/{g}") for g in sorted(gone)]
    events += [etcd.node(f"new{i}") for i in range(newcomers)]
    view = apply(view, events)
    if not view.nodes:
        return
    m2 = plan_round(view, s, "n0", "again")
    check_manifest(m2, len(view.nodes), max_nodes)
    before = {m.node_id: m.group_rank for m in m1.members}
    for m in m2.members:
        if m.node_id in before and before[m.node_id] < len(m2.members):
            assert m.group_rank == before[m.node_id]
    survivors = [n for n in before if n not in gone]
    members2 = {m.node_id for m in m2.members}
    # Survivors are kept before any newcomer or spare.
    assert set(survivors[:max_nodes]) <= members2


def check_manifest(m: Manifest, present: int, max_nodes: int) -> None:
    assert len(m.members) == min(present, max_nodes)
    assert [x.group_rank for x in m.members] == list(range(len(m.members)))
    ranks = [r for x in m.members for r in range(x.rank_offset, x.rank_offset + x.nproc)]
    assert ranks == list(range(m.world_size))
    assert len(m.spares) == present - len(m.members)
    assert m.master_addr == m.members[0].address


def test_settings_from_the_operators_job_record() -> None:
    from stalwart.api.job_record import JobRecord

    rec = JobRecord(job_name="j", namespace="ns", uid="u", members=["a", "b"], min_nodes=1, max_nodes=2,
                    nproc_per_node=4, join_timeout_seconds=90, last_call_seconds=3, lease_ttl_seconds=1,
                    max_restarts=3, soft_timeout_seconds=10, hard_timeout_seconds=20,
                    barrier_timeout_seconds=30, backoff_limit=2)
    s = RendezvousSettings.from_job_record(rec)
    assert (s.min_nodes, s.max_nodes, s.last_call_timeout, s.join_timeout, s.node_ttl) == (1, 2, 3, 90, 2)


class SimEtcd(Etcd):
    """Etcd's transaction rules for the claim and the seal, over the same revision counter, with an event log and
    the keys as they are now (a node's keys share its lease: they go together)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[KeyPut | KeyDeleted] = []
        self.now: dict[str, KeyPut] = {}

    @property
    def mods(self) -> dict[str, int]:
        return {k: v.mod_revision for k, v in self.now.items()}

    def record(self, *events: KeyPut | KeyDeleted) -> None:
        for ev in events:
            self.log.append(ev)
            if isinstance(ev, KeyPut):
                self.now[ev.key] = ev
            else:
                self.now.pop(ev.key, None)

    def lose(self, node_id: str) -> None:
        """The node's lease ends: its key, and the sealer's key if it holds it, go at one revision."""
        self.revision += 1
        keys = ["nodes/" + node_id]
        held = self.now.get("sealer")
        if held is not None and SealerRecord.from_json_bytes(held.value).node_id == node_id:
            keys.append("sealer")
        for key in keys:
            self.created.pop(key, None)
            self.record(KeyDeleted(key, self.revision))

    def claim_txn(self, claim: Claim) -> bool:
        if "sealer" in self.now or self.created.get("nodes/" + claim.node_id, 0) != claim.node_revision:
            return False
        self.record(self.sealer(claim.node_id))
        return True

    def seal_txn(self, seal: Seal) -> bool:
        sealer_key = "nodes/" + seal.sealer
        if (self.mods.get("manifest", 0) != seal.over_epoch or "closed" in self.now
                or self.created.get(sealer_key, 0) != seal.sealer_revision
                or any(self.created[k] > seal.view_revision for k in self.now if k.startswith("nodes/"))):
            return False
        self.record(self.seal(seal))
        return True

    def read(self, local: frozenset[str], full: bool) -> View:
        """A process's view as the driver reads it (:mod:`stalwart.agent.rendezvous.reading`)."""
        def kv(p: KeyPut, keys_only: bool = False) -> KeyValue:
            return KeyValue(p.key, b"" if keys_only else p.value, p.create_revision, p.mod_revision, 1, p.lease)

        if full:
            return replace(apply(View(), [self.now[k] for k in sorted(self.now)]), revision=self.revision, memo={})
        control = [[kv(self.now[k])] if k in self.now else [] for k in ("manifest", "request", "closed",
                                                                       "expected", "sealer")]
        reads = [*control, [], *([[kv(self.now[k])] if k in self.now else [] for k in
                                  sorted("nodes/" + n for n in local)])]
        sealed = "manifest" in self.now
        if sealed:
            reads.append([kv(self.now[k], True) for k in sorted(self.now) if k.startswith("nodes/")])
        return light_view("", TxnResult(not sealed, self.revision, reads, [len(r) for r in reads]))


def _entry(put: KeyPut) -> NodeEntry:
    return NodeEntry(NodeRecord.from_json_bytes(put.value), put.create_revision, put.lease)


@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["join", "die", "deliver", "tick", "request"]),
                           st.integers(0, 7)), min_size=1, max_size=60),
    min_nodes=st.integers(1, 3),
    extra=st.integers(0, 3),
)
# A node registered after the sealer's view but before its transaction was once left out of the round
# without being a late arrival (the seal's transaction did not compare the node set).
@example(ops=[("join", 0), ("deliver", 0), ("tick", 0), ("join", 1), ("tick", 0)], min_nodes=1, extra=1)
# The sealer's node dies: another process claims the key and reads the prefix in full.
@example(ops=[("join", 0), ("join", 1), ("deliver", 0), ("deliver", 1), ("die", 0), ("deliver", 1)],
         min_nodes=1, extra=0)
# A member is lost and no new round can be sealed: light views learn it from the deletion alone.
@example(ops=[("join", 0), ("join", 1), ("deliver", 0), ("deliver", 1), ("deliver", 2), ("die", 1),
              ("deliver", 2)], min_nodes=2, extra=0)
def test_processes_agree_on_rounds_whatever_the_interleaving(
        ops: list[tuple[str, int]], min_nodes: int, extra: int) -> None:
    """Three processes of two or three nodes each, fed etcd's events in any interleaving, each with the view
    the driver would hold (full while one of its nodes holds the sealer's key, light otherwise: no puts of node
    keys, its own learnt at registration): every manifest etcd accepts is sealed by the key's holder over a
    full view of the round it replaces, with unique ranks; at the end, once enough nodes are present, a live
    round holds every node present at its seal, all processes agree on it and on its being live, and only
    nodes that arrived after it wait."""
    s = RendezvousSettings(min_nodes=min_nodes, max_nodes=min_nodes + extra, last_call_timeout=5)
    etcd = SimEtcd()
    owner = {f"n{i}": i % 3 for i in range(8)}
    procs = [State(local=frozenset(n for n, p in owner.items() if p == i), view=View(full=False))
             for i in range(3)]
    cursors = [0, 0, 0]
    now = 0.0
    sealed_over: set[int] = set()

    def holds_key(i: int) -> bool:
        view = procs[i].view
        return view.sealer is not None and view.sealer.node_id in procs[i].local

    def act(i: int, actions: list[object]) -> None:
        for a in actions:
            if isinstance(a, Claim):
                etcd.claim_txn(a)  # refused when another holds it: the watch brings the holder
            elif isinstance(a, Seal):
                view = procs[i].view
                assert view.full and view.sealer is not None
                assert a.sealer == view.sealer.node_id and a.sealer in procs[i].local
                assert {m.node_id for m in a.manifest.members} <= set(view.nodes)
                check_manifest(a.manifest, len(view.nodes), s.max_nodes)
                if etcd.seal_txn(a):
                    assert a.over_epoch not in sealed_over  # one round per epoch it replaces
                    sealed_over.add(a.over_epoch)
                else:
                    # Refused (another view was newer): the driver reports it; a retry comes later.
                    procs[i], _ = step(procs[i], SealFailed(now), s)
        if holds_key(i) != procs[i].view.full:
            # The driver reads the prefix again, in full or light, and watches from there.
            cursors[i] = len(etcd.log)
            procs[i], more = step(procs[i], Reloaded(etcd.read(procs[i].local, holds_key(i)), now), s)
            act(i, list(more))

    def deliver(i: int) -> None:
        events = tuple(ev for ev in etcd.log[cursors[i]:]
                       if procs[i].view.full or isinstance(ev, KeyDeleted) or not ev.key.startswith("nodes/"))
        cursors[i] = len(etcd.log)
        if events:
            procs[i], actions = step(procs[i], Observed(events, now), s)
            act(i, list(actions))

    for op, arg in ops:
        node = f"n{arg}"
        if op == "join" and "nodes/" + node not in etcd.now:
            # The registration claims the sealer's key in its own write while nobody holds it.
            put = etcd.node(node)
            holder = etcd.now.get("sealer")
            if holder is None:
                etcd.created["sealer"] = put.mod_revision
                holder = KeyPut("sealer", SealerRecord(node_id=node).to_json_bytes(), put.mod_revision,
                                put.mod_revision, 1)
                etcd.record(put, holder)
            else:
                etcd.record(put)
            claim = SealerClaim(SealerRecord.from_json_bytes(holder.value).node_id, holder.create_revision, 1)
            i = owner[node]
            procs[i], actions = step(procs[i], LocalNode(node, True, now, _entry(put), claim), s)
            act(i, list(actions))
        elif op == "die" and "nodes/" + node in etcd.now:
            etcd.lose(node)
        elif op == "deliver":
            deliver(arg % 3)
        elif op == "tick":
            now += 3.0
            procs[arg % 3], actions = step(procs[arg % 3], Tick(now), s)
            act(arg % 3, list(actions))
        elif op == "request" and "manifest" in etcd.now:
            req = RerendezvousRequest(epoch=etcd.mods["manifest"], node_id=node)
            etcd.record(etcd.put("request", req.to_json_bytes()))
    # Quiesce: deliver everything and let every last call run out, until nothing changes.
    for _ in range(10):
        now += 10.0
        for i in range(3):
            deliver(i)
            procs[i], actions = step(procs[i], SealFailed(now), s)
            act(i, list(actions))
    for i in range(3):
        deliver(i)
    present = {k[len("nodes/"):]: v.create_revision for k, v in etcd.now.items() if k.startswith("nodes/")}
    full = etcd.read(frozenset(), True)
    if present:
        # A present node claimed the key, and its process holds the full view.
        assert full.sealer is not None and full.sealer.node_id in present
        assert procs[owner[full.sealer.node_id]].view.full
    if len(present) >= min_nodes:
        assert round_status(full).live
        assert full.sealed is not None
        m = full.sealed.manifest
        listed = {x.node_id for x in m.members} | set(m.spares)
        # Nodes outside the round are exactly the late arrivals (they wait for a requested next round).
        late = {n for n, c in present.items() if c > full.epoch}
        assert set(present) - listed == late - listed
        assert set(waiting_nodes(full)) == late | (set(present) - listed)
    assert all(p.view.epoch == full.epoch for p in procs)
    # Light or full, every process judges the round as etcd's state does.
    assert all(round_status(p.view).live == round_status(full).live for p in procs)


def _bucketed(etcd: Etcd, seal: Seal) -> list[KeyPut]:
    """The seal of ``seal`` as a large manifest: buckets and header at one revision."""
    value, parts = encode_manifest(seal.manifest, part_bytes=1024)
    etcd.revision += 1
    return [*(KeyPut(manifest_part_key(i), p, etcd.revision, etcd.revision) for i, p in enumerate(parts)),
            KeyPut("manifest", value, etcd.revision, etcd.revision)]


@pytest.mark.parametrize(("spare", "bucketed", "ends"), [
    (False, True, True),  # no one to take the lost ranks: the last call runs, the light views are told now
    (True, True, False),  # a spare is there: the seal follows at once and tells everyone
    (False, False, False),  # a manifest of one record: every view knows every member, no one needs telling
])
def test_the_sealer_ends_a_large_round_for_the_light_views_when_no_seal_follows(
        spare: bool, bucketed: bool, ends: bool) -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=12, last_call_timeout=5)
    etcd = Etcd()
    nodes = tuple(etcd.node(f"node-{i:02d}") for i in range(12))
    st0, acts = run(State(local=frozenset({"node-00"})), Observed((*nodes, etcd.sealer("node-00")), 0.0), s)
    [seal] = seals(acts)
    sealed = _bucketed(etcd, seal) if bucketed else [etcd.seal(seal)]
    st1, acts = run(st0, Observed(tuple(sealed), 0.1), s)
    assert acts == [] and round_status(st1.view).live and st1.view.sealed.bucketed == bucketed  # type: ignore[union-attr]
    lost = (etcd.delete("nodes/node-07"), *((etcd.node("spare-0", spare=True),) if spare else ()))
    st2, acts = run(st1, Observed(lost, 0.2), s)
    ending = [a for a in acts if isinstance(a, EndRound)]
    if ends:
        assert ending == [EndRound(st1.view.epoch, "node-00", "member lost: node-07", ("node-07",))]
        assert acts[-1] == WakeAt(5.2)
        _, again = run(st2, Tick(1.0), s)
        assert not any(isinstance(a, EndRound) for a in again)  # once per round
    else:
        assert ending == []
        assert len(seals(acts)) == (1 if spare else 0)
