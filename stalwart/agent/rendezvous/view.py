"""What one process knows of a job's rendezvous prefix: the records etcd holds, and the :class:`View` built from
etcd's events by :func:`apply`. Pure: no I/O, no clock. :mod:`.protocol` judges a view and decides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from stalwart.agent.rendezvous.errors import CorruptRecord
from stalwart.api.manifest import MANIFEST_PARTS, ManifestHeader, RoundPart, decode_round
from stalwart.api.rendezvous import (
    ExpectedNodes,
    Manifest,
    Member,
    NodeRecord,
    RerendezvousRequest,
    SealerRecord,
)
from stalwart.etcd.keys import CLOSED, EXPECTED, MANIFEST, NODES, REQUEST, SEALER

__all__ = ["KeyDeleted", "KeyEvent", "KeyPut", "NodeEntry", "SealedRound", "SealerClaim", "View", "apply",
           "parse_record"]

_M = TypeVar("_M", NodeRecord, Manifest, RerendezvousRequest, ExpectedNodes, SealerRecord)



# -- what etcd holds ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """A present node: its record and the revision its key was created at (its age; its incarnation)."""

    record: NodeRecord
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class SealerClaim:
    """The ``sealer`` key: the node holding it, and the key's create_revision and lease."""

    node_id: str
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class SealedRound:
    """A sealed round and its epoch (the manifest key's mod_revision): its header, and its members (by node id,
    in group rank order when whole) and spares (node id -> index) as far as this view holds them. A full view
    and any view of a small manifest (one document) hold it whole (``manifest``); a light view of a large one
    holds the buckets of its own nodes (``knows``)."""

    part: RoundPart
    epoch: int
    #: The manifest key's value, to read the round again when more of its buckets arrive.
    value: bytes = field(default=b"", compare=False, repr=False)

    @property
    def header(self) -> ManifestHeader:
        return self.part.header

    @property
    def manifest(self) -> Manifest | None:
        return self.part.manifest

    @property
    def members(self) -> Mapping[str, Member]:
        return self.part.members

    @property
    def spares(self) -> Mapping[str, int]:
        return self.part.spares

    @property
    def bucketed(self) -> bool:
        return bool(self.part.header.buckets)

    def knows(self, node_id: str) -> bool:
        return self.part.knows(node_id)

    @classmethod
    def of(cls, manifest: Manifest, epoch: int) -> SealedRound:
        return cls(decode_round(manifest.to_json_bytes(), {}), epoch)


@dataclass(frozen=True, slots=True)
class KeyPut:
    """A key under the rendezvous prefix was written. ``key`` is relative to the prefix."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class KeyDeleted:
    """A key under the rendezvous prefix was deleted (or its lease expired). ``key`` is relative."""

    key: str
    mod_revision: int


KeyEvent = KeyPut | KeyDeleted


@dataclass(frozen=True, slots=True)
class View:
    """What one process knows of the rendezvous prefix, as of etcd revision ``revision``.

    A **full** view (``full``) holds every node key; a light one only the keys of this process's nodes (see the
    module's rules). Both hold every deletion of a node key since the last seal's view in ``gone`` (node id
    -> revision of its latest deletion). ``nodes`` and ``gone`` must not be mutated: :func:`apply` returns a
    new View with new mappings when they change. ``problems`` lists records that failed to parse (key ->
    message); they are ignored otherwise.
    """

    revision: int = 0
    nodes: Mapping[str, NodeEntry] = field(default_factory=dict)
    sealed: SealedRound | None = None
    request: RerendezvousRequest | None = None
    closed: bool = False
    expected: frozenset[str] | None = None
    sealer: SealerClaim | None = None
    #: The revision of the last deletion of the sealer's key (0: none seen).
    sealer_gone: int = 0
    gone: Mapping[str, int] = field(default_factory=dict)
    full: bool = True
    problems: Mapping[str, str] = field(default_factory=dict)
    #: The parts of a large manifest (relative key -> value, mod_revision); see :func:`decode_manifest`.
    parts: Mapping[str, tuple[bytes, int]] = field(default_factory=dict, repr=False)
    #: Memo of :func:`round_status` for this (immutable) view: a thousand waiting nodes ask the same view.
    memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def epoch(self) -> int:
        """The epoch of the last sealed round, 0 when none."""
        return 0 if self.sealed is None else self.sealed.epoch


def parse_record(model: type[_M], key: str, value: bytes) -> _M:
    """Parse one JSON record; raises :class:`CorruptRecord` naming the key and what is wrong."""
    try:
        return model.from_json_bytes(value)
    except ValueError as e:
        raise CorruptRecord(key, f"not a valid {model.__name__} JSON document: {e}") from None


def apply(view: View, events: Sequence[KeyEvent]) -> View:
    """The view after ``events`` (in revision order). Corrupt records are recorded in ``problems`` and
    otherwise ignored, so one bad value cannot stop the rendezvous."""
    nodes: dict[str, NodeEntry] | None = None
    gone: dict[str, int] | None = None
    sealed, request, closed, expected = view.sealed, view.request, view.closed, view.expected
    sealer, sealer_gone = view.sealer, view.sealer_gone
    problems = dict(view.problems)
    revision = view.revision
    parts: dict[str, tuple[bytes, int]] | None = None
    # The manifest is read once the batch is applied: a read lists "manifest" before its buckets.
    manifest: KeyPut | None = None
    for ev in events:
        revision = max(revision, ev.mod_revision)
        key = ev.key
        problems.pop(key, None)
        try:
            if key.startswith(NODES):
                node_id = key[len(NODES):]
                if nodes is None:
                    nodes = dict(view.nodes)
                if isinstance(ev, KeyDeleted):
                    if gone is None:
                        gone = dict(view.gone)
                    gone[node_id] = ev.mod_revision
                    entry = nodes.get(node_id)
                    if entry is not None and entry.create_revision < ev.mod_revision:
                        del nodes[node_id]
                    continue
                record = parse_record(NodeRecord, key, ev.value)
                if record.node_id != node_id:
                    raise CorruptRecord(key, f"nodeId {record.node_id!r} does not match the key")
                nodes[node_id] = NodeEntry(record, ev.create_revision, ev.lease)
            elif key.startswith(MANIFEST_PARTS):
                if parts is None:
                    parts = dict(view.parts)
                if isinstance(ev, KeyDeleted):
                    parts.pop(key, None)
                else:
                    parts[key] = (ev.value, ev.mod_revision)
            elif key == MANIFEST:
                manifest = None
                if isinstance(ev, KeyDeleted):
                    sealed = None
                else:
                    manifest = ev
            elif key == REQUEST:
                request = None if isinstance(ev, KeyDeleted) else parse_record(RerendezvousRequest, key, ev.value)
            elif key == CLOSED:
                closed = isinstance(ev, KeyPut)
            elif key == EXPECTED:
                expected = None if isinstance(ev, KeyDeleted) else frozenset(
                    parse_record(ExpectedNodes, key, ev.value).node_ids)
            elif key == SEALER:
                # A claim learnt from a registration's answer may be newer than an event still on its way.
                if isinstance(ev, KeyDeleted):
                    sealer_gone = ev.mod_revision
                    if sealer is not None and sealer.create_revision < ev.mod_revision:
                        sealer = None
                elif sealer is None or ev.create_revision >= sealer.create_revision:
                    sealer = SealerClaim(parse_record(SealerRecord, key, ev.value).node_id, ev.create_revision,
                                         ev.lease)
        except CorruptRecord as e:
            problems[key] = str(e)
    if manifest is None and parts is not None and sealed is not None and sealed.bucketed:
        # More buckets of the round held: read it again (a light view's own buckets come after its header).
        manifest = KeyPut(MANIFEST, sealed.value, 0, sealed.epoch)
    if manifest is not None:
        try:
            sealed = _sealed(manifest, view.parts if parts is None else parts, whole=view.full)
        except CorruptRecord as e:
            problems[MANIFEST] = str(e)
    if sealed is not view.sealed and sealed is not None and (gone or view.gone):
        # Deletions up to the new round's view are of incarnations it did not take: forget them.
        planned = sealed.header.view_revision
        gone = {n: r for n, r in (view.gone if gone is None else gone).items() if r > planned}
    return View(revision=revision, nodes=view.nodes if nodes is None else nodes, sealed=sealed,
                request=request, closed=closed, expected=expected, sealer=sealer, sealer_gone=sealer_gone,
                gone=view.gone if gone is None else gone, full=view.full, problems=problems,
                parts=view.parts if parts is None else parts)


def _sealed(ev: KeyPut, parts: Mapping[str, tuple[bytes, int]], *, whole: bool) -> SealedRound:
    """The round a put of the manifest key seals, whole or as far as ``parts`` hold its buckets; raises
    :class:`CorruptRecord` if it cannot be read (whole, for a full view)."""
    try:
        return SealedRound(decode_round(ev.value, parts, whole=whole), ev.mod_revision, ev.value)
    except ValueError as e:
        raise CorruptRecord(MANIFEST, f"not a valid Manifest: {e}") from None
